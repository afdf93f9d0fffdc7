"""From options to compiled graphs: the configuration record, the pipeline and its budget search, the torch.compile backend, the Inductor scheduler pass and the plan shared across ranks."""
