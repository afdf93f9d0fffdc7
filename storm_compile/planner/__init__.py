"""The step's memory ledger and the records a compile served from torch's caches still needs."""
