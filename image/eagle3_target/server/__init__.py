"""The target server (``eagle3-target serve``): FastAPI app, engine worker, NeMo compatibility routes.

Kept import-light: the CLI imports ``eagle3_target.server.cli`` without pulling in torch or FastAPI.
"""
