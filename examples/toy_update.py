"""One FlashREINFORCE update on the CPU with the fused loss, from scratch (nothing downloaded).

A tiny randomly initialized GPT-2 samples one trajectory per prompt (recording the behavior
log-probabilities at sampling time, as a rollout engine would), a toy reward scores each
trajectory, and one optimizer step is taken through ``flashreinforce_loss_packed`` on the packed
batch. Prints the loss, the acceptance rate of the trust region and the retained tokens.

    python examples/toy_update.py [--batch 8] [--new-tokens 24] [--seed 0]
"""

from __future__ import annotations

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import flashreinforce as fr

VOCAB = 64


def sample(model, prompt: torch.Tensor, new_tokens: int, generator: torch.Generator):
    """Samples a continuation; returns the full sequence and the sampled tokens' log-probs."""
    tokens = prompt.clone()
    behavior = []
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(tokens[None]).logits[0, -1].float()
            logp = torch.log_softmax(logits, dim=-1)
            nxt = torch.multinomial(logp.exp(), 1, generator=generator)
            behavior.append(logp[nxt])
            tokens = torch.cat([tokens, nxt])
    return tokens, torch.cat(behavior)


def token_log_probs(model, tokens: torch.Tensor) -> torch.Tensor:
    """log p(token_t | tokens_<t) for t >= 1, aligned so that index t holds token t's log-prob."""
    logp = torch.log_softmax(model(tokens[None]).logits[0, :-1].float(), dim=-1)
    picked = logp.gather(1, tokens[1:, None])[:, 0]
    return torch.cat([torch.zeros(1), picked])  # position 0 (a prompt token) has no log-prob


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    # A model this small runs fastest on one thread (intra-op threading costs more than the work,
    # and much more when the other cores are busy).
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)

    config = GPT2Config(vocab_size=VOCAB, n_positions=128, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # no dropout: learner = sampler
    model = GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    # Rollouts: prompts of varying length, one sampled continuation each.
    sequences, masks, behaviors, rewards = [], [], [], []
    for i in range(args.batch):
        prompt = torch.randint(0, VOCAB, (3 + i % 4,), generator=gen)
        tokens, behavior = sample(model, prompt, args.new_tokens, gen)
        mask = torch.zeros(len(tokens), dtype=torch.bool)
        mask[len(prompt):] = True
        full_behavior = torch.zeros(len(tokens))
        full_behavior[len(prompt):] = behavior
        # Toy reward: the share of even token ids in the continuation (the "task").
        rewards.append(float((tokens[len(prompt):] % 2 == 0).float().mean()))
        sequences.append(tokens)
        masks.append(mask)
        behaviors.append(full_behavior)

    # Learner: pack, recompute current log-probs, fused loss, one step.
    cu_seqlens = torch.zeros(args.batch + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.tensor([len(s) for s in sequences]).cumsum(0)
    log_probs = torch.cat([token_log_probs(model, s) for s in sequences])
    loss, stats = fr.flashreinforce_loss_packed(
        log_probs, torch.cat(behaviors), torch.tensor(rewards), cu_seqlens, torch.cat(masks), delta=3e-3)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()

    with torch.no_grad():
        after = torch.cat([token_log_probs(model, s) for s in sequences])
    mask = torch.cat(masks)
    adv = stats["advantages"].repeat_interleave(cu_seqlens.diff().long())
    moved = float(((after - log_probs.detach())[mask] * adv[mask]).sum())
    print(f"loss {loss.item():+.6f}")
    print(f"acceptance rate {stats['acceptance_rate'].item():.3f} "
          f"(sequence KL max {stats['sequence_kl'].max().item():.2e})")
    print(f"retained tokens {int(stats['retained_tokens'].sum())} of {int(stats['policy_tokens'].sum())} policy tokens")
    print(f"advantage-weighted log-prob change after the step: {moved:+.4f} (positive: the update followed A)")


if __name__ == "__main__":
    main()
