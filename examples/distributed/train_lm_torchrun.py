#!/usr/bin/env python3
"""Trains a small causal LM (transformers' LlamaForCausalLM from its config, random weights) for --steps steps on
several torch.distributed ranks (gloo) with its head through fusedhead.distributed, and on one process beside it on
every rank, from the same initial weights and batches, and prints both losses per step and their largest relative
difference.

    torchrun --nproc-per-node 2 examples/distributed/train_lm_torchrun.py --parallel data --wrapper fsdp2

(with FUSEDHEAD_LIBRARY=$PWD/build/libfusedhead.so PYTHONPATH=python in a build tree).

--parallel data: each rank takes its share of every batch's sequences. fusedhead's loss is the mean over every rank's
tokens and its weight gradient is already summed over the ranks, so lm_head stays outside the wrapper. The body's
gradients are each rank's part of that one loss's and must be summed over the ranks, while DDP (--wrapper ddp) and
FSDP2 (--wrapper fsdp2: fully_shard on every decoder layer, then the body) average them: the hidden states'
gradient is multiplied by the number of ranks on its way into the body (a tensor hook), which makes their average
the sum. (FSDP2's set_gradient_divide_factor(1.0) would say the same, but gloo has no PREMUL_SUM.)
--parallel vocab: every rank takes the whole batch and holds a contiguous shard of lm_head's rows; fusedhead
combines the ranks' statistics and returns the whole vocabulary's loss and hidden-state gradient on every rank, so
the body's gradients are already equal everywhere (no wrapper: nothing to reduce), and each rank's shard of the
weight gradient.
The single process trains the same model on the whole batch with fusedhead.torch.causal_lm_loss (lm_run.py). The
data is made here (random sequences, each seen several times); nothing is downloaded.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import fusedhead.distributed
from lm_run import Setup, parse_args


def wrap(body: torch.nn.Module, wrapper: str) -> torch.nn.Module:
    """The body, data-parallel: its gradients averaged over the ranks."""
    if wrapper == "ddp":
        return DistributedDataParallel(body)
    for module in (*body.layers, body):  # the layers, then the rest of the body
        fully_shard(module)
    return body


def main() -> None:
    args = parse_args(__doc__, lambda p: p.add_argument("--wrapper", choices=("ddp", "fsdp2"), default="ddp",
                                                        help="the body's wrapper (data-parallel)"))
    dist.init_process_group("gloo")
    size = dist.get_world_size()
    run = Setup(args, dist.get_rank(), size)
    vocab = run.vocab_parallel
    world = dist.group.WORLD
    layout = fusedhead.distributed.Layout(run.local_vocab, vocab_group=world if vocab else None,
                                          data_group=None if vocab else world)
    context = fusedhead.distributed.Context(layout, threads=1)
    if vocab:
        run.train(run.model.model, context)
    else:  # the wrapper's average of the body's gradients becomes their sum
        run.train(wrap(run.model.model, args.wrapper), context, hidden_hook=lambda grad: grad * size)
    context.close()
    layout.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
