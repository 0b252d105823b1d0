"""A two-process driver through SGLang's own scheduler queues (prefill and decode), every byte checked.

Where ``devtools.sglang_pair`` calls the transfer managers directly, this driver lets SGLang's
own scheduler code make every call a real scheduler makes: on the prefill,
``PrefillBootstrapQueue`` (``add``, ``pop_bootstrapped``, which builds the manager from the pools
itself), the prefill mixin's ``send_kv_chunk`` and ``process_disagg_prefill_inflight_queue``; on
the decode, ``DecodePreallocQueue`` (``add``, ``pop_preallocated``) and ``DecodeTransferQueue``
(``add``, ``pop_transferred``), driven by the decode mixin's own ``process_decode_queue``. The
schedulers are stand-ins holding only what that code reads; the pools, requests (``Req``), token
pools, allocators, tree caches and metadata buffers are SGLang's own. ``side`` is the child
process (one per side), ``pair`` the parent; ``migrate`` (parent) and ``migrate_side`` (its
children, the queue pair's too) move a request from one decode's running batch to another's.
"""
