"""From options to compiled graphs: the pipeline and its budget search, the torch.compile
backend, and the Inductor scheduler pass that keeps copies in place."""
