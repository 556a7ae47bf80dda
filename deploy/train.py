"""A small DDP training job with the torshmon probe attached, for docker-compose and Kubernetes.

Run it under torchrun, next to a ``torshmon agent`` whose socket is
``$TORSHMON_AGENT_SOCKET``::

    torchrun --standalone --nproc-per-node 2 deploy/train.py --steps 1000

gloo on CPU, NCCL when every rank has a GPU. The job is named by ``$TORSHMON_JOB``.
``--steps 0`` trains until stopped: SIGTERM ends it cleanly at the next check.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from types import FrameType

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import torshmon

#: Steps between the ranks' agreement on stopping.
STOP_CHECK_EVERY = 10
_stop = False


def _request_stop(_signum: int, _frame: FrameType | None) -> None:
    global _stop
    _stop = True


def _all_stop(device: torch.device | None) -> bool:
    """Whether any rank was asked to stop. Ranks see SIGTERM at different steps, and
    one leaving the loop alone would leave its peers inside DDP's all-reduce."""
    flag = torch.tensor([1.0 if _stop else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item() > 0)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=0, help="steps to train (0: until stopped)")
    parser.add_argument("--hidden", type=int, default=512, help="MLP width (512)")
    parser.add_argument("--layers", type=int, default=4, help="MLP depth (4)")
    parser.add_argument("--batch-size", type=int, default=64, help="per rank (64)")
    parser.add_argument("--sleep-s", type=float, default=0.0, help="pause after each step")
    parser.add_argument(
        "--bucket-timing", action="store_true", help="time every DDP bucket (collectives view)"
    )
    args = parser.parse_args()
    for name in ("steps", "hidden", "layers", "batch_size"):
        low = 0 if name == "steps" else 1
        if getattr(args, name) < low:
            parser.error(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}")
    return args


def main() -> None:
    args = parse_args()
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if use_cuda else None
    if device is not None:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU()]
    model = DistributedDataParallel(torch.nn.Sequential(*layers[:-1]).to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1000 + rank)
    target = (torch.randn(args.hidden, args.hidden, generator=generator) / args.hidden**0.5).to(
        device
    )
    monitor = torshmon.attach(model, bucket_timing=args.bucket_timing)
    signal.signal(signal.SIGTERM, _request_stop)
    step = 0
    try:
        while args.steps == 0 or step < args.steps:
            if step % STOP_CHECK_EVERY == 0 and _all_stop(device):
                break
            x = torch.randn(args.batch_size, args.hidden, generator=generator).to(device)
            with monitor.step(batch_size=args.batch_size) as scope:
                loss = torch.nn.functional.mse_loss(model(x), x @ target)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                scope.loss = loss
            step += 1
            if args.sleep_s:
                time.sleep(args.sleep_s)
    finally:
        monitor.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
