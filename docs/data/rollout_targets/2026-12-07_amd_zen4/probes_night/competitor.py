"""A competing load: small bf16 products (20 x 576 @ 576 x 1536, 60 of them a round) on 2 threads, as a
decode step's; ``python competitor.py SECONDS`` runs it as its own process."""
import sys
import time

import torch


def products(keep_going) -> int:
    """Rounds of the products while ``keep_going()``; how many ran."""
    w = [torch.randn(576, 1536, dtype=torch.bfloat16) for _ in range(60)]
    x = torch.randn(20, 576, dtype=torch.bfloat16)
    n = 0
    while keep_going():
        for m in w:
            x @ m
        n += 1
        time.sleep(0.002)
    return n


if __name__ == "__main__":
    torch.set_num_threads(2)
    end = time.time() + float(sys.argv[1])
    print("competitor rounds", products(lambda: time.time() < end))
