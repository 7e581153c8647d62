"""SIGKILL a process while it saves, again and again: each file it writes must still load and hold exactly the
state of one step it reached (the previous save or the new one, never a mix), and killed writes must not leave
files piling up."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import onnx
import pytest
from onnx.external_data_helper import ExternalDataInfo, uses_external_data

import onnxtrain
from crash_saver import EXTERNAL, INLINE, STATE, digest, model

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL is POSIX")

KILLS = 20
SAVER = Path(__file__).with_name("crash_saver.py")


def start_saver(folder: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SAVER.parent), *sys.path]))
    return subprocess.Popen([sys.executable, str(SAVER), str(folder)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, text=True)


def recorded(folder: Path, step: int) -> str:
    return (folder / "digests" / str(step)).read_text()


def check_file(folder: Path, name: str, reader: onnxtrain.Engine) -> int:
    """The step the file holds, after checking its state is that step's recorded one."""
    if name == STATE:
        reader.load_state(folder / name)
        engine = reader
    else:
        engine = onnxtrain.load(folder / name)
    assert digest(engine.state) == recorded(folder, engine.step_count), f"{name} mixes states"
    return engine.step_count


def leftovers(folder: Path) -> list[str]:
    """Files that are neither a target, nor the data file the external export refers to, nor a digest."""
    exported = onnx.load(folder / EXTERNAL, load_external_data=False)
    graphs = [exported.graph] + [g for i in exported.training_info for g in (i.initialization, i.algorithm)]
    referenced = {ExternalDataInfo(t).location for g in graphs for t in g.initializer if uses_external_data(t)}
    assert len(referenced) == 1
    return sorted(set(os.listdir(folder)) - {STATE, INLINE, EXTERNAL, "digests"} - referenced)


def test_saves_survive_sigkill(tmp_path):
    chance = random.Random(20261123)
    reader = onnxtrain.load(model())
    steps = {STATE: 0, INLINE: 0, EXTERNAL: 0}
    for kill in range(KILLS):
        saver = start_saver(tmp_path)
        assert saver.stdout.readline() == "saved\n", saver.stderr.read()  # up and past its first round of saves
        time.sleep(chance.uniform(0.0, 0.3))  # the saver spends most of its time writing files
        saver.send_signal(signal.SIGKILL)
        saver.wait()
        assert saver.returncode == -signal.SIGKILL, saver.stderr.read()
        saver.stdout.close()
        saver.stderr.close()
        for name in steps:
            step = check_file(tmp_path, name, reader)
            assert step >= steps[name], f"kill {kill}: {name} went back from step {steps[name]} to {step}"
            steps[name] = step
        # at most what one killed export leaves per path: a staging model file and one unreferenced data file
        left = leftovers(tmp_path)
        assert len([n for n in left if re.fullmatch(rf"\.{re.escape(EXTERNAL)}\.\w+\.tmp", n)]) <= 1, left
        assert len([n for n in left if n.endswith(".data")]) <= 1, left
        assert all(re.fullmatch(r"\.(state\.npz|inline\.onnx|external\.onnx)\.\w+\.tmp|external\.onnx\.\w+\.data", n)
                   for n in left), left
    assert steps[STATE] >= KILLS  # every saver completed at least one round
