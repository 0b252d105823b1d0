import torch

import pdstate
from pdstate.agent import DecodeAgent, PrefillAgent, RequestState
from pdstate.pools.memory import BufferSpec, SharedMemory

# The serving engine's own pools and tensors (pdstate's DSV4 pools stand in for SGLang's here).
# The engine allocates, keeps and frees them; the agents only register them. With the default
# shm engine the decode's memory must be /dev/shm segments the prefill can map.
prefill_pools = pdstate.build_worker_pools(pdstate.preset("tiny"))
decode_mem = SharedMemory()
decode_pools = pdstate.build_worker_pools(pdstate.preset("tiny"), memory=decode_mem)
prefill_kv = pdstate.fill_kv_args(prefill_pools.target, prefill_pools.draft)
decode_kv = pdstate.fill_kv_args(decode_pools.target, decode_pools.draft)

# Aux (metadata) buffers: one 64-byte row per request slot, moved with the last chunk.
prefill_aux = torch.zeros(8, 64, dtype=torch.uint8)
(decode_aux,) = decode_mem.allocate("aux", [BufferSpec("aux", (8, 64), torch.uint8)])
for kv, aux in ((prefill_kv, prefill_aux), (decode_kv, decode_aux)):
    kv.aux_data_ptrs, kv.aux_data_lens, kv.aux_item_lens = [aux.data_ptr()], [aux.nbytes], [64]

# What prefill computed: pages 1 and 2 of the first C4 KV buffer, and the request's metadata.
c4_src = prefill_pools.target.c4_kv_buffers[0]
c4_src[1:3] = torch.randint(0, 256, c4_src[1:3].shape, dtype=torch.uint8)
prefill_aux[2] = 7

prefill = PrefillAgent(prefill_kv, (prefill_pools.target, prefill_pools.draft))  # binds tcp://127.0.0.1:<port>
decode = DecodeAgent(decode_kv, (decode_pools.target, decode_pools.draft))

# The router picked this prefill and room; the decode names them and where things land:
# destination pages, one index list per state component (swa, c128_state, draft swa), aux slot.
recv = decode.receiver(prefill.address, room=1)
recv.init([3, 4], [[1], [0], [1]], aux_index=3)

# The prefill sends in chunks as it progresses; state components go with the last chunk only.
send = prefill.sender(room=1, num_pages=2, aux_index=2)
send.send([1])
send.send([2], state_indices=[[2], [1], [2]])

assert recv.wait(10) is RequestState.SUCCESS, recv.failure_exception()  # digests compared
assert send.wait(10) is RequestState.SUCCESS
c4_dst = decode_pools.target.c4_kv_buffers[0]
print("pages landed:", torch.equal(c4_dst[3:5], c4_src[1:3]), "aux:", decode_aux[3].tolist() == [7] * 64)
print("metrics:", sorted(recv.metrics))

decode.close()
prefill.close()
decode_mem.close()  # the caller's memory, the caller's to free
