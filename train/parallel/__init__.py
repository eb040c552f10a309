"""Running on many processes: the process group and devices (distributed.py), DDP or FSDP2 wrapping
(wrapping.py), each rank's share of the data and its loader workers (data.py, loader_server.py), and who
hung when a collective times out (hang.py)."""
