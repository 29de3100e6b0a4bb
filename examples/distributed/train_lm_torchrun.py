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
The single process trains the same model on the whole batch with fusedhead.torch.causal_lm_loss. The data is made
here (random sequences, each seen several times); nothing is downloaded.
"""
from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist
import transformers
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import fusedhead.distributed
import fusedhead.torch as ft


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parallel", choices=("data", "vocab"), default="data")
    p.add_argument("--wrapper", choices=("ddp", "fsdp2"), default="ddp", help="the body's wrapper (data-parallel)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8, help="sequences per step, over every rank")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def shard(count: int, parts: int, r: int):
    base, extra = divmod(count, parts)
    return r * base + min(r, extra), base + (r < extra)


def batches_of(args) -> list:
    """--steps batches drawn from 2 x --batch fixed random sequences: the model memorises them, so the loss falls
    within the steps."""
    corpus = torch.randint(0, args.vocab, (2 * args.batch, args.seq))
    return [corpus[torch.randperm(len(corpus))[:args.batch]] for _ in range(args.steps)]


def wrap(body: torch.nn.Module, wrapper: str) -> torch.nn.Module:
    """The body, data-parallel: its gradients averaged over the ranks."""
    if wrapper == "ddp":
        return DistributedDataParallel(body)
    for module in (*body.layers, body):  # the layers, then the rest of the body
        fully_shard(module)
    return body


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    config = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=args.seq, tie_word_embeddings=False)
    single = transformers.LlamaForCausalLM(config)
    model = copy.deepcopy(single)
    batches = batches_of(args)

    vocab = args.parallel == "vocab"
    lo, count = shard(args.vocab, size, rank) if vocab else (0, args.vocab)
    head = torch.nn.Parameter(model.lm_head.weight.detach()[lo:lo + count].clone())
    world = dist.group.WORLD
    layout = fusedhead.distributed.Layout(count, vocab_group=world if vocab else None,
                                          data_group=None if vocab else world)
    context = fusedhead.distributed.Context(layout, threads=1)
    first, mine = shard(args.batch, 1 if vocab else size, 0 if vocab else rank)
    body = model.model if vocab else wrap(model.model, args.wrapper)
    optimizer = torch.optim.AdamW([*body.parameters(), head], lr=args.lr)
    single_optimizer = torch.optim.AdamW(single.parameters(), lr=args.lr)

    worst = 0.0
    for step, ids in enumerate(batches):
        # distributed: this rank's sequences; labels are the ids, shifted inside the loss as transformers does
        mine_ids = ids[first:first + mine]
        hidden = body(input_ids=mine_ids).last_hidden_state
        if not vocab:  # the wrapper's average of the body's gradients becomes their sum
            hidden.register_hook(lambda grad: grad * size)
        loss = ft.causal_lm_loss(hidden, head, mine_ids, context=context)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

        single_hidden = single.model(input_ids=ids).last_hidden_state
        single_loss = ft.causal_lm_loss(single_hidden, single.lm_head.weight, ids)
        single_optimizer.zero_grad()
        single_loss.backward()
        single_optimizer.step()

        loss, single_loss = float(loss.detach()), float(single_loss.detach())
        diff = abs(loss - single_loss) / abs(single_loss)
        worst = max(worst, diff)
        if rank == 0:
            print(f"step {step:3d}  loss {loss:.6f}  one process {single_loss:.6f}  rel diff {diff:.2e}",
                  flush=True)
    if rank == 0:
        how = "" if vocab else f", body in {args.wrapper}"
        print(f"{args.parallel}-parallel on {size} ranks{how}, {args.steps} steps: largest relative loss difference "
              f"{worst:.2e}", flush=True)
    context.close()
    layout.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
