"""What both scale-out training examples share (train_lm_torchrun.py, train_lm_mpi4py.py): the arguments, a small
transformers Llama from its config (random weights) with a copy for the one-process run beside it, the batches, this
rank's shard of the head, and the loop that trains both and compares their losses step by step."""
from __future__ import annotations

import argparse
import copy
from typing import Callable, List, Tuple

import torch
import transformers

import fusedhead.torch as ft


def parse_args(doc: str, extra: Callable[[argparse.ArgumentParser], None] = lambda p: None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parallel", choices=("data", "vocab"), default="data")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8, help="sequences per step, over every rank")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    extra(p)
    return p.parse_args()


def shard(count: int, parts: int, r: int) -> Tuple[int, int]:
    """Part r of count items in parts contiguous blocks whose sizes differ by at most one: (first, size)."""
    base, extra = divmod(count, parts)
    return r * base + min(r, extra), base + (r < extra)


class Setup:
    """The model trained across ranks and its one-process twin (the same initial weights), the batches, and this
    rank's part: its sequences (data-parallel) or its rows of lm_head (vocab-parallel)."""

    def __init__(self, args: argparse.Namespace, rank: int, size: int):
        torch.manual_seed(args.seed)
        config = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                                          intermediate_size=2 * args.hidden, num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, max_position_embeddings=args.seq,
                                          tie_word_embeddings=False)
        self.single = transformers.LlamaForCausalLM(config)
        self.model = copy.deepcopy(self.single)
        # --steps batches drawn from 2 x --batch fixed random sequences: the model memorises them, so the loss falls
        corpus = torch.randint(0, args.vocab, (2 * args.batch, args.seq))
        self.batches: List[torch.Tensor] = [corpus[torch.randperm(len(corpus))[:args.batch]] for _ in range(args.steps)]
        self.vocab_parallel = args.parallel == "vocab"
        self.rank, self.size, self.args = rank, size, args
        lo, self.local_vocab = shard(args.vocab, size, rank) if self.vocab_parallel else (0, args.vocab)
        self.head = torch.nn.Parameter(self.model.lm_head.weight.detach()[lo:lo + self.local_vocab].clone())
        self.first, self.mine = shard(args.batch, 1 if self.vocab_parallel else size, 0 if self.vocab_parallel else rank)

    def train(self, body: torch.nn.Module, context, after_backward: Callable[[], None] = lambda: None,
              hidden_hook: Callable[[torch.Tensor], torch.Tensor] = None) -> None:
        """--steps steps of body + the fused head across the ranks and of the one-process model, printing both
        losses per step (rank 0) and their largest relative difference. after_backward runs after each distributed
        backward (a reduction of the body's gradients); hidden_hook, when given, is the hidden states' gradient hook."""
        optimizer = torch.optim.AdamW([*body.parameters(), self.head], lr=self.args.lr)
        single_optimizer = torch.optim.AdamW(self.single.parameters(), lr=self.args.lr)
        worst = 0.0
        for step, ids in enumerate(self.batches):
            # distributed: this rank's sequences; labels are the ids, shifted inside the loss as transformers does
            mine_ids = ids[self.first:self.first + self.mine]
            hidden = body(input_ids=mine_ids).last_hidden_state
            if hidden_hook is not None:
                hidden.register_hook(hidden_hook)
            loss = ft.causal_lm_loss(hidden, self.head, mine_ids, context=context)
            optimizer.zero_grad()
            loss.backward()
            after_backward()
            optimizer.step()

            single_hidden = self.single.model(input_ids=ids).last_hidden_state
            single_loss = ft.causal_lm_loss(single_hidden, self.single.lm_head.weight, ids)
            single_optimizer.zero_grad()
            single_loss.backward()
            single_optimizer.step()

            loss, single_loss = float(loss.detach()), float(single_loss.detach())
            diff = abs(loss - single_loss) / abs(single_loss)
            worst = max(worst, diff)
            if self.rank == 0:
                print(f"step {step:3d}  loss {loss:.6f}  one process {single_loss:.6f}  rel diff {diff:.2e}",
                      flush=True)
        if self.rank == 0:
            print(f"{self.args.parallel}-parallel on {self.size} ranks, {self.args.steps} steps: largest relative loss "
                  f"difference {worst:.2e}", flush=True)
