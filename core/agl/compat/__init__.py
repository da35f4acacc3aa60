"""Agent Lightning v0.3 compatibility: its module paths and names, served by agl's own machinery.

Code written for Agent Lightning runs with ``import agl`` in place of ``import agentlightning as agl``
(docs/agent-lightning.md). Nothing here is imported by ``import agl`` except :mod:`agl.compat.aliases`, the
small tables that resolve Agent Lightning's paths (``agl.tracer.agentops``) and names (``agl.OtelTracer``)
to the modules of this package when they are first asked for.
"""
