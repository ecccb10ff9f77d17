"""kvfs.metaserver: block metadata, placement, membership and the cache's lifecycle.

config.py     MetaserverConfig, the server's settings
state.py      MetaState: prefix keys -> blocks -> chunk replicas in RocksDB; allocate, commit, match
chains.py     the chain table over failure domains and placement by free space
eviction.py   capacity eviction policies (leaves first; LRU, LFU-DA), pure and simulated by kvfs-bench
lifecycle.py  TTL and allocation expiry, capacity eviction, chunk deletion, orphan GC, rebuild
repair.py     reconciling servers back from silence and re-replicating chunks short of copies
service.py    the gRPC servicer; main.py the `kvfs-metaserver` entry point
"""
