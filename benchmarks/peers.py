"""The peers of one benchmark model: onnxtrain, hand-written JAX + optax, PyTorch eager and ONNX Runtime.

Each peer is a pair of zero-argument callables (a train step, an inference) that return only once the work is
done, so a wall-clock timer around one call measures that call; `launch_train` starts a step without waiting for
it, as a training loop that does not read each step's loss runs (`launched` times those). Every peer gets the
same batch, already where it computes from (device arrays for JAX and onnxtrain, tensors for PyTorch, NumPy for
ONNX Runtime), so no peer pays a host-to-device copy the others do not.

Where JAX's default backend is a GPU, PyTorch runs on CUDA and ONNX Runtime on its CUDA provider when its build
has one (the CPU provider otherwise: `ORT_PROVIDER` says which). Every peer multiplies float32 matrices at the
precision `set_precision` chose: "highest" (full float32, what ONNX specifies and onnxtrain's default) or
"default" (TF32 on NVIDIA GPUs since Ampere, for JAX, PyTorch and onnxtrain alike; the same bits on a CPU).
"""

from __future__ import annotations

import copy
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import onnxruntime
import optax
import torch

import onnxtrain
import onnxtrain.program
from models import CLASSES, Bench

# First calls are cold compiles: JAX's persistent cache, which onnxtrain turns on by default, would make a second
# run of a benchmark read them back (benchmarks/compile_cache.py measures that warm case).
os.environ["ONNXTRAIN_CACHE_DIR"] = ""
jax.config.update("jax_enable_compilation_cache", False)
# Timings are a long run's steady state: onnxtrain plans a program's temporaries in heaps from its hundredth call
# on the CPU (onnxtrain/program.py); here from its second, so that it happens in the untimed warm-up.
onnxtrain.program.SPLIT_AFTER_CALLS = 2

LR, BETA1, BETA2, EPS = 1e-3, 0.9, 0.999, 1e-6
WARM = 0.05  # seconds of untimed calls before each timed turn (interleaved); ort_training.py uses the same
Call = Callable[[], Any]
ON_GPU = jax.default_backend() == "gpu"
TORCH_DEVICE = torch.device("cuda" if ON_GPU and torch.cuda.is_available() else "cpu")
ORT_PROVIDER = ("CUDAExecutionProvider" if ON_GPU and "CUDAExecutionProvider" in onnxruntime.get_available_providers()
                else "CPUExecutionProvider")
PRECISION: dict[str, str] = {}


def set_precision(precision: str) -> None:
    """Float32 matrix products and convolutions of every peer: "highest" (full float32) or "default" (TF32 where
    the hardware has it)."""
    PRECISION["matmul"] = precision
    tf32 = precision == "default"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32  # PyTorch's own default is True for convolutions, False for matmuls


set_precision("highest")  # PyTorch's own defaults differ (TF32 convolutions): every peer starts alike


def torch_ready(value: Any) -> Any:
    """`value` once PyTorch has computed it: CUDA kernels run asynchronously to the Python that launched them."""
    if TORCH_DEVICE.type == "cuda":
        torch.cuda.synchronize()
    return value


@dataclass
class Peer:
    launch_train: Call | None  # starts one optimizer step on the batch, returns its result (None: cannot train)
    infer: Call  # logits of the batch
    state_bytes: int  # parameters + optimizer state held between train steps
    ready: Callable[[Any], Any] = jax.block_until_ready  # a launched step's result, once computed
    lower_train: Callable[[], jax.stages.Lowered] | None = None  # the XLA program of a train step (jitted peers)

    @property
    def train(self) -> Call | None:
        """One optimizer step, returning once it is done."""
        launch, ready = self.launch_train, self.ready
        return None if launch is None else lambda: ready(launch())

    def launched(self, steps: int) -> Call:
        """`steps` optimizer steps launched back to back, waiting only for the last."""
        def run() -> Any:
            for _ in range(steps - 1):
                self.launch_train()
            return self.ready(self.launch_train())
        return run


@dataclass(frozen=True)
class Batch:
    x: np.ndarray  # float32 [N, *input_shape]
    y: np.ndarray  # int64 class labels [N]


def make_batch(bench: Bench, batch: int, seed: int = 0) -> Batch:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(batch, *bench.input_shape)).astype(np.float32)
    return Batch(x, rng.integers(0, CLASSES, size=batch).astype(np.int64))


def nbytes(tree: Any) -> int:
    return sum(int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree))


def onnxtrain_peer(bench: Bench, data: Batch) -> Peer:
    """make_trainable(cross_entropy, adam) for the train step; the plain inference model for infer."""
    trainable = onnxtrain.make_trainable(bench.model, loss="cross_entropy", optimizer="adam", learning_rate=LR,
                                         alpha=BETA1, beta=BETA2, epsilon=EPS)
    precision = PRECISION["matmul"]
    trainer = onnxtrain.load(trainable, matmul_precision=precision)
    inferer = onnxtrain.load(bench.model, matmul_precision=precision)
    with jax.enable_x64(True):  # the ONNX label dtype is int64; outside x64 mode JAX would make it int32
        x, y = jax.device_put(data.x), jax.device_put(data.y)
    return Peer(launch_train=lambda: trainer.train_step({"X": x, "target": y}),
                infer=lambda: jax.block_until_ready(inferer.infer({"X": x})), state_bytes=nbytes(dict(trainer.state)),
                lower_train=lambda: trainer.lower({"X": x, "target": y}, algorithm=0))


def jax_peer(bench: Bench, data: Batch) -> Peer:
    """What a JAX user writes: one jitted value_and_grad + optax.adam step, parameters and moments donated."""
    optimizer = optax.adam(LR, b1=BETA1, b2=BETA2, eps=EPS)

    def loss_fn(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
        return optax.softmax_cross_entropy_with_integer_labels(bench.forward(params, x), y).mean()

    # the precision is read while tracing, so it is set inside the jitted functions, not around every call
    @jax.jit
    def infer(params: dict, x: jax.Array) -> jax.Array:
        with jax.default_matmul_precision(PRECISION["matmul"]):
            return bench.forward(params, x)

    def step(params: dict, opt_state: Any, x: jax.Array, y: jax.Array) -> tuple:
        with jax.default_matmul_precision(PRECISION["matmul"]):
            loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    train_step = jax.jit(step, donate_argnums=(0, 1))
    params = {k: jnp.asarray(v) for k, v in bench.params.items()}
    frozen = {k: jnp.asarray(v) for k, v in bench.params.items()}  # infer's own copy: train donates `params`
    state = {"params": params, "opt": optimizer.init(params)}
    x, y = jnp.asarray(data.x), jnp.asarray(data.y.astype(np.int32))

    def launch() -> jax.Array:
        state["params"], state["opt"], loss = train_step(state["params"], state["opt"], x, y)
        return loss

    return Peer(launch_train=launch, infer=lambda: jax.block_until_ready(infer(frozen, x)),
                state_bytes=nbytes(state), lower_train=lambda: train_step.lower(state["params"], state["opt"], x, y))


def torch_peer(bench: Bench, data: Batch) -> Peer:
    """PyTorch eager: a module copy (training changes it), cross_entropy, torch.optim.Adam with its defaults."""
    trained = copy.deepcopy(bench.module).to(TORCH_DEVICE)
    frozen = copy.deepcopy(bench.module).to(TORCH_DEVICE)
    optimizer = torch.optim.Adam(trained.parameters(), lr=LR, betas=(BETA1, BETA2), eps=EPS)
    x, y = torch.from_numpy(data.x).to(TORCH_DEVICE), torch.from_numpy(data.y).to(TORCH_DEVICE)

    def launch() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(trained(x), y)
        loss.backward()
        optimizer.step()
        return loss

    def infer() -> torch.Tensor:
        with torch.no_grad():
            return torch_ready(frozen(x))

    state = sum(p.numel() * p.element_size() * 3 for p in trained.parameters())  # weights + Adam's two moments
    return Peer(launch_train=launch, infer=infer, state_bytes=state, ready=torch_ready)


def ort_peer(bench: Bench, data: Batch) -> Peer:
    """ONNX Runtime's InferenceSession on the inference model, ORT_PROVIDER, default session options."""
    session = onnxruntime.InferenceSession(bench.model.SerializeToString(), providers=[ORT_PROVIDER])
    feeds = {"X": data.x}
    return Peer(launch_train=None, infer=lambda: session.run(None, feeds), state_bytes=0)


PEERS: dict[str, Callable[[Bench, Batch], Peer]] = {
    "onnxtrain": onnxtrain_peer, "jax": jax_peer, "torch": torch_peer, "ort": ort_peer,
}


def first_call(call: Call) -> float:
    """Seconds of the first call: for the jitted peers, tracing and compiling plus one run."""
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def warm_up(call: Call, seconds: float) -> None:
    """Untimed calls for `seconds` (at least one)."""
    start = time.perf_counter()
    call()
    while time.perf_counter() - start < seconds:
        call()


def interleaved(
    calls: dict[Any, Call], steps: int, rounds: int, settle: float = 0.05, warm: float = WARM
) -> dict[Any, float]:
    """Median seconds per call of each callable over `steps` calls, made in `rounds` rounds that alternate
    between the callables (and rotate which goes first), so drift on the machine hits all of them alike.

    Before each callable's turn the process sleeps `settle` seconds (PyTorch's OpenMP and ONNX Runtime's workers
    spin-wait after their last call, and on a small machine a spinning core would slow whoever runs next), then
    calls it untimed for `warm` seconds: after the pause and the previous callable's turn, the first calls run
    slower (cold caches, idle cores), while a training loop calls its step back to back.
    """
    times: dict[Any, list[float]] = {name: [] for name in calls}
    names = list(calls)
    per_round = max(1, steps // rounds)
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            call = calls[name]
            time.sleep(settle)
            warm_up(call, warm)
            for _ in range(per_round):
                start = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}
