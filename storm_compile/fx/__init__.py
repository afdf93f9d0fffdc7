"""Facts about FX graphs that every layer shares: node vocabulary, the graph pair and pass context,
the plan records the passes exchange, what the simulator predicts, and torch's private APIs."""
