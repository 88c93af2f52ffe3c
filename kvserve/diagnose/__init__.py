"""The evidence chain: from engine counters and request timelines to ranked
findings with a concrete fix.

- recorder.py: engine-owned counters no cache keeps (arrivals, the prefix
  reuse an unbounded cache would get, at several block sizes) and the recent
  finished requests' timelines.
- window.py: a window of metric samples -> rates, trends, TTFT split (evidence).
- rules.py: evidence -> findings (stable codes, severity, evidence, fix).
- sources.py: where samples come from (a live server, a JSON record file).
- drive.py: run a workload through `LLM` while sampling (offline records).
- report.py: text and JSON output; cli.py: `kvserve diagnose`.
- endpoint.py: the server's `/debug/kvserve` route and the engine-core snapshot
  behind it (configuration, metrics, KV groups, recent timelines).
"""
