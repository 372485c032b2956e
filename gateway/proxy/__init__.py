"""The upstream exchange of an admitted request, top to bottom.

- plan.py: :class:`~kvscope.gateway.proxy.plan.ProxyPlan`, what admission decided (where, what, how to read
it).
- call.py: :class:`~kvscope.gateway.proxy.call.ProxyCall`, the ASGI app that runs one plan: replicas, retries,
  deadlines, the client's disconnect, errors; it applies what the relay returns to the request context.
- relay.py: reads one upstream answer (an SSE stream event by event, or a JSON completion) and returns a
  :class:`~kvscope.gateway.proxy.relay.RelayOutcome`; it never touches the call or the request context.
- client.py: the client's half of the exchange (the ASGI ``send``, whether the response started).
- passthrough.py: the ``/v1/*`` paths the gateway does not interpret, forwarded unchanged.
- upstreams.py: the replica pool (health, selection, passive ejection).

Dependencies point down that list: call → relay → client; no module here imports one that imports it back.
"""
