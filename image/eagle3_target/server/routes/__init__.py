"""The server's routes, one module-level router per audience; `server.app` assembles them."""
