"""A workload with a known speed-up: under any mode but fp32 each step does half the arithmetic.

Every step trains a small linear model (so the loss curves compare as usual) and then multiplies
fixed fp32 matrices: ``--work`` times under fp32, half as often under any other mode. The ratio
of the two holds on any CPU and under any steady load, since both share the cores alike: what a
test of the measuring needs, whatever this CPU's bf16 does.

With ``DISTURB_MARKER`` set to a path that does not exist yet, the first fp32 run creates it and,
from its tenth step, starts ``DISTURB_PROCESSES`` CPU-bound processes beside itself (a neighbour's
job starting during the reference); they end with the trial, which ends everything it started.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import torch

import advisor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=int, default=16)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()

    # One thread: a step's time then follows its share of the cores smoothly under load, where
    # two threads that wait on each other turn a busy machine into steps 20x apart.
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x, y = torch.randn(64, 32), torch.randn(64, 1)
    a, b = torch.randn(args.size, args.size), torch.randn(args.size, args.size)
    mp = advisor.load_policy()
    net = torch.nn.Linear(32, 1)
    model, optimizer = mp.setup(net, torch.optim.SGD(net.parameters(), lr=0.05))
    fp32 = mp.policy.mode == "fp32"
    marker = os.environ.get("DISTURB_MARKER")
    disturb = bool(marker) and fp32 and not os.path.exists(marker)
    if disturb:
        open(marker, "w").close()
    burners: list[subprocess.Popen[bytes]] = []
    with mp:
        for step in range(args.steps):
            if disturb and step == 10:
                burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                           for _ in range(int(os.environ.get("DISTURB_PROCESSES", "4")))]
            for _ in range(args.work if fp32 else args.work // 2):
                torch.mm(a, b)
            xb, yb = mp.to_device(x, y)
            with mp.autocast():
                loss = torch.nn.functional.mse_loss(model(xb).float(), yb)
            mp.step(loss, optimizer)
    for burner in burners:
        burner.kill()


if __name__ == "__main__":
    main()
