"""Listening sockets: the connection guard both of hostpool's listeners use (the HTTP
listener here, the share socket in `hostpool.share`), and the HTTP listener."""
