"""Stops: the signals that ask a run to stop and the ranks' agreement on it (signals.py), and the markers
in which the workers tell each node's launcher how they ended (markers.py). Both import only the standard
library at the top: the launcher and the loader workers' fork server read them before torch."""
