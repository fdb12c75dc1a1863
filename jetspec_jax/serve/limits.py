"""The HTTP server's default limits, shared by http_server.py and the command line, which builds its flags
before it imports the server (start-up imports stay inside its signal handling)."""

DEFAULT_MAX_BODY_BYTES = 1 << 20  # a prompt of ~250K tokens as text; the context is far smaller
DEFAULT_HEADER_TIMEOUT = 10.0  # seconds from a connection (or a request's first byte) to its whole head
DEFAULT_BODY_TIMEOUT = 30.0  # seconds from a request's head to the end of its body
DEFAULT_MAX_CONNECTIONS = 512  # open connections at which a new request gets 503
