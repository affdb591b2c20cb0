"""Other projects' attention kernels, fetched at run time (never committed) as peers."""
