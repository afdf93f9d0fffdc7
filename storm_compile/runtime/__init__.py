"""What runs beside the compiled graphs: the typed transfer ops, their copy streams, pinned host
pool and host thread, what storm learns of the training loop, and the same plan on every rank."""
