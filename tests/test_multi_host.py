"""Multi-host data parallelism for real: two processes on this machine, each a JAX host with two (virtual CPU)
devices, joined by jax.distributed over localhost with gloo collectives. Training over the four devices must
give the state one device gives, whether each host feeds the whole batch (NumPy) or only its own rows (a global
array built with the engine's batch_sharding), with the state replicated or split across the hosts (shard_state),
and process 0 exports the trained model (with split state, every host exports: the export gathers it)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
from test_training import mlp_params

WORKER = r"""
import sys
import numpy as np
import jax
from jax.experimental import multihost_utils

process, port, tests, exported = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2, process_id=process)
sys.path.insert(0, tests)
import onnxtrain
from training_models import mlp_adam
from test_training import mlp_params

assert (len(jax.devices()), len(jax.local_devices())) == (4, 2), jax.devices()
rng = np.random.default_rng(0)
x = rng.normal(size=(64, 4)).astype(np.float32)
t = rng.normal(size=(64, 2)).astype(np.float32)
model = mlp_adam(mlp_params(), lr=0.01)
single = onnxtrain.load(model, devices=jax.local_devices()[:1])
hosts = onnxtrain.load(model, devices=jax.devices())
sharded = onnxtrain.load(model, devices=jax.devices(), shard_state=True)  # each host holds half of each weight
for engine in (single, hosts, sharded):
    engine.init()
mine = slice(32 * process, 32 * (process + 1))
for step in range(10):
    single.train_step({"X": x, "Target": t})
    if step % 2:  # each host passes only its own 32 rows
        feeds = {name: jax.make_array_from_process_local_data(hosts.batch_sharding, value[mine])
                 for name, value in (("X", x), ("Target", t))}
    else:  # each host passes the whole batch
        feeds = {"X": x, "Target": t}
    hosts.train_step(feeds)
    sharded.train_step(feeds)
for name, value in single.state.items():
    np.testing.assert_allclose(np.asarray(hosts.state[name]), np.asarray(value), rtol=1e-5, atol=1e-6,
                               err_msg=name)
    np.testing.assert_allclose(multihost_utils.process_allgather(sharded.state[name], tiled=True),
                               np.asarray(value), rtol=1e-5, atol=1e-6, err_msg=name)
assert not sharded.state["W1"].is_fully_addressable
sharded.export(f"{exported}.{process}")  # gathers the split state: every host calls it
y = hosts.infer({"X": x})["Y"]
assert not y.is_fully_addressable  # the rows of the output live on both hosts
np.testing.assert_allclose(multihost_utils.process_allgather(y, tiled=True), np.asarray(single.infer({"X": x})["Y"]),
                           rtol=1e-5, atol=1e-6)
if process == 0:
    hosts.export(exported)
multihost_utils.sync_global_devices("exported")
print("SAME STATE", process)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_hosts_train_to_the_state_of_one_device(tmp_path: Path):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    exported = tmp_path / "trained.onnx"
    port = str(free_port())
    hosts = [subprocess.Popen([sys.executable, "-c", WORKER, str(process), port, str(Path(__file__).parent),
                               str(exported)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for process in (0, 1)]
    try:
        results = [host.communicate(timeout=300) for host in hosts]
    finally:
        for host in hosts:
            host.kill()
    for process, (host, (out, err)) in enumerate(zip(hosts, results)):
        assert host.returncode == 0, f"process {process}:\n{err[-3000:]}"
        assert f"SAME STATE {process}" in out
    trained = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(exported).graph.initializer}
    assert not np.allclose(trained["W1"], mlp_params()["W1"]), "the export holds the initial weights"
    for process in (0, 1):  # each host's export of the split state holds the whole trained weights
        gathered = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(f"{exported}.{process}").graph.initializer}
        for name, value in trained.items():
            np.testing.assert_allclose(gathered[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
