"""The cache-aware router: `banyan route` in front of engine replicas, and `banyan serve --dp N`.

args (RouterArgs), keys (what a request's prefix is), tree (approximate multi-worker radix tree),
policies (cache_aware, round_robin, shortest_queue, random), workers (registry, health, load),
proxy (forwarding with retry before the first byte), metrics, app (FastAPI), launch (processes).
"""
