"""Helpers with no agl dependencies above ``types``/``errors``: an HTTP server thread, fork safety, progress
bars, client-disconnect checks and the guard that keeps agl's own bugs out of a user's agent."""
