#!/usr/bin/env python3
"""Trains a small causal LM (transformers' LlamaForCausalLM from its config, random weights) for --steps steps on
several MPI ranks with its head through fusedhead.mpi, and on one process beside it on every rank, from the same
initial weights and batches, and prints both losses per step and their largest relative difference.

    mpirun -np 2 env FUSEDHEAD_LIBRARY=$PWD/build/libfusedhead.so PYTHONPATH=python \\
        .venv/bin/python examples/distributed/train_lm_mpi4py.py --parallel data

--parallel data: each rank takes its share of every batch's sequences; fusedhead's loss is the mean over every
rank's tokens, its weight gradient already summed over the ranks, so the body's gradients (each rank's part of that
one loss's) are summed with an all-reduce, not averaged.
--parallel vocab: every rank takes the whole batch and holds a contiguous shard of lm_head's rows; fusedhead
combines the ranks' statistics, returns the whole vocabulary's loss and hidden-state gradient on every rank (so the
body's gradients are already equal everywhere) and each rank's shard of the weight gradient.
The single process trains the same model on the whole batch with fusedhead.torch.causal_lm_loss (lm_run.py). The
data is made here (random sequences, each seen several times); nothing is downloaded.
"""
from __future__ import annotations

from mpi4py import MPI

import fusedhead.mpi
from lm_run import Setup, parse_args


def main() -> None:
    args = parse_args(__doc__)
    world = MPI.COMM_WORLD
    run = Setup(args, world.Get_rank(), world.Get_size())
    vocab = run.vocab_parallel
    layout = fusedhead.mpi.Layout(run.local_vocab, vocab_comm=world if vocab else None,
                                  data_comm=None if vocab else world)
    context = fusedhead.mpi.Context(layout, threads=1)
    body = run.model.model

    def sum_body_gradients() -> None:  # each rank holds its tokens' part of the one loss's body gradient
        for p in body.parameters():
            world.Allreduce(MPI.IN_PLACE, p.grad.numpy(), op=MPI.SUM)

    run.train(body, context, after_backward=(lambda: None) if vocab else sum_body_gradients)
    context.close()
    layout.close()


if __name__ == "__main__":
    main()
