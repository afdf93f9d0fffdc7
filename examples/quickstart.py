"""Train a small transformer stack with storm holding half its activation memory.

    python examples/quickstart.py

On a GPU storm keeps, offloads or recomputes each activation saved for the backward so that
half of them are held at the end of the forward; without one it compiles the same graphs for
the CPU (a budget there plans nothing, the CPU's memory being the host's, and storm warns so).
Prints each step's loss.
"""

import torch

from storm_compile import storm
from storm_compile.cli.models import GPTShape, build_gpt

STEPS = 3
SHAPE = GPTShape(d_model=256, layers=2, heads=4, seq=128, batch=2, dtype="float32")
"""Small enough to compile in about a minute on a laptop's CPU."""


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model, (x,) = build_gpt(SHAPE, device)
    compiled = torch.compile(model, backend=storm(memory_budget=0.5))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(STEPS):
        loss = compiled(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        print(f"step {step}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
