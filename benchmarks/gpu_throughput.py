"""One rank training a ResNet-18 on synthetic images on the GPU: plain torch, hvd_magic's
DistributedOptimizer and torch DDP (NCCL, a world of 1), side by side in one process. At
one rank nothing needs reducing, so the gap to plain torch is the wrapper's own cost
(gradient hooks, bucket copies, a negotiation and an NCCL allreduce of size 1).

    mpiexec -n 1 python benchmarks/gpu_throughput.py                   # on a GPU
    mpiexec -n 1 python benchmarks/gpu_throughput.py --device cpu --quick   # dry run

Each round trains every variant once, in a rotating order, on a fresh model with the same
seed (warm-up steps, then timed steps ending in a device synchronize); the figures are
medians over rounds with their range. The last line starts with ``RESULT`` and holds the
figures benchmarks/gpu_check.sh prints; ``--json PATH`` writes them too.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import hvd_magic.torch as hvd


# ---------------------------------------------------------------- ResNet-18 (He et al. 2015)
class Block(nn.Module):
    """Two 3x3 convolutions with batch norm and a shortcut (1x1 convolution where the
    shape changes)."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
            nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout))
        self.short = (nn.Sequential() if stride == 1 and cin == cout else
                      nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)))

    def forward(self, x):
        return torch.relu(self.body(x) + self.short(x))


def resnet18(classes: int = 1000) -> nn.Module:
    """11.7 M parameters in 62 tensors, as torchvision's resnet18."""
    layers = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
              nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [Block(cin, cout, stride), Block(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, classes)]
    return nn.Sequential(*layers)


# ---------------------------------------------------------------- one timed run
def run(variant: str, dev: torch.device, args) -> float:
    """Images per second of ``variant`` (plain, hvd or ddp) over ``args.steps`` steps."""
    torch.manual_seed(0)
    model = resnet18().to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if variant == "hvd":
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    elif variant == "ddp":
        model = nn.parallel.DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None)
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(args.batch, 3, args.image_size, args.image_size, generator=g).to(dev)
    y = torch.randint(0, 1000, (args.batch,), generator=g).to(dev)
    loss_fn = nn.CrossEntropyLoss()

    def step():
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    for _ in range(args.warmup):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync()
    return args.batch * args.steps / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true",
                   help="a smoke test: batch 2 of 3x64x64, 1 warm-up and 2 timed steps, 1 round")
    p.add_argument("--json", help="also write the figures to this file")
    args = p.parse_args()
    if args.quick:
        args.batch, args.image_size, args.warmup, args.steps, args.rounds = 2, 64, 1, 2, 1

    hvd.init()
    if hvd.size() != 1:
        raise SystemExit(f"gpu_throughput.py measures one rank; it was started on {hvd.size()} "
                         "(run it with mpiexec -n 1)")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("gpu_throughput.py --device cuda needs a CUDA GPU "
                             "(torch.cuda.is_available() is False); --device cpu runs a dry run")
        torch.cuda.set_device(hvd.local_rank())
        dev = torch.device("cuda", torch.cuda.current_device())
        torch.backends.cudnn.benchmark = True
        where = torch.cuda.get_device_name(dev)
    else:
        dev = torch.device("cpu")
        where = "CPU"
    # One process group of one rank for DDP; hvd_magic's torch.distributed backend shares
    # it (same rank and size), so hvd's CUDA gradients go through the same NCCL.
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", store=store, rank=0, world_size=1)

    variants = ["plain", "hvd", "ddp"]
    rates: dict = {v: [] for v in variants}
    print(f"gpu_throughput: ResNet-18, batch {args.batch} of 3x{args.image_size}x{args.image_size}, "
          f"{where}, {args.rounds} round(s) of {args.warmup} warm-up + {args.steps} timed steps",
          flush=True)
    for r in range(args.rounds):
        order = variants[r % 3:] + variants[:r % 3]
        for v in order:
            rates[v].append(run(v, dev, args))
        print(f"  round {r + 1}: " + ", ".join(f"{v} {rates[v][-1]:.1f}" for v in variants) + " img/s",
              flush=True)
    med = {v: statistics.median(rates[v]) for v in variants}
    labels = {"plain": "plain torch", "hvd": "hvd DistributedOptimizer", "ddp": "torch DDP (1 rank)"}
    for v in variants:
        print(f"  {labels[v]:<26} {med[v]:9.1f} img/s  ({min(rates[v]):.1f}..{max(rates[v]):.1f})"
              f"  {med[v] / med['plain']:.3f}x plain", flush=True)
    result = {"device": where, "batch": args.batch, "image_size": args.image_size,
              "img_per_s": med, "all": rates,
              "hvd_vs_plain": med["hvd"] / med["plain"], "ddp_vs_plain": med["ddp"] / med["plain"]}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(f"RESULT {where}: plain {med['plain']:.1f}, hvd {med['hvd']:.1f} "
          f"({result['hvd_vs_plain']:.3f}x), DDP {med['ddp']:.1f} ({result['ddp_vs_plain']:.3f}x) img/s",
          flush=True)
    hvd.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
