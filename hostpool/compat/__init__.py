"""Drop-in shims for servers that use hostpool without changing their code.

`hostpool.compat.sglang`: sglang's host-allocator names and signatures.
"""
