"""The KV cache's bookkeeping: device pages (page_allocator.py), the prefix cache over the radix
tree (prefix_cache.py), and the tiers below the device: host memory (host.py) and disk
(disk.py), moved between by tiers.py.
"""
