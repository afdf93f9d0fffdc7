"""Parameters kept in host memory and read on the device through a copy in the traced graph, the
8- and 4-bit host formats of frozen ones, and their staying in host memory through ``.to()``."""
