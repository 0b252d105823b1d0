"""DSV4 memory pools: the SWA allocator with its index mapping, and the target/draft KV pools."""

from pdstate.pools.allocator import MappingIdentity, ReqToTokenPool, SWATokenToKVPoolAllocator
from pdstate.pools.dsv4 import DeepSeekV4TokenToKVPool
from pdstate.pools.memory import BufferSpec, PrivateMemory, SharedMemory

__all__ = [
    "BufferSpec",
    "DeepSeekV4TokenToKVPool",
    "MappingIdentity",
    "PrivateMemory",
    "ReqToTokenPool",
    "SWATokenToKVPoolAllocator",
    "SharedMemory",
]
