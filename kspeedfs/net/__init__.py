"""Connections to a node: the one handshake, the blocking and trio clients, the TCP transport."""
