"""The TF32 switches of a fresh process come back exactly after fp32/tf32 on CUDA.

A fresh process reads cuDNN's TF32 as on (``cudnn.allow_tf32`` True, convolutions and RNNs
"tf32") while their own new-API switches are unset, a state no setter can produce again; the
unit tests reset the switches through the setters first, so only a fresh interpreter shows it.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

CHECK = """
import torch
from probes import matmul_switches

get = torch._C._get_fp32_precision_getter
switches = [("generic", "all"), ("cuda", "all"), ("cuda", "matmul"), ("cuda", "conv"), ("cuda", "rnn"),
            ("mkldnn", "all"), ("mkldnn", "matmul")]

def state():
    try:
        cudnn = torch.backends.cudnn.allow_tf32
    except RuntimeError:
        cudnn = "refused"
    return [torch.get_float32_matmul_precision(), cudnn] + [get(*s) for s in switches]

before = state()
with matmul_switches(tf32={tf32}, cuda=True):
    pass
after = state()
print(before == after, before, after)
"""


@pytest.mark.skipif(not hasattr(torch.backends, "fp32_precision"), reason="this torch has only the legacy TF32 API")
@pytest.mark.parametrize("tf32", [False, True])
def test_a_fresh_process_reads_the_same_switches_after_the_block(tf32):
    proc = subprocess.run([sys.executable, "-c", CHECK.format(tf32=tf32)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("True"), proc.stdout
