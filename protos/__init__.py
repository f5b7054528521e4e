"""Protocol buffers: the source of truth of every wire message; generated stubs beside them."""
