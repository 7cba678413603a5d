"""CPU benchmark of the data plane: what rlfleet's Redis Streams path costs over raw redis-py.

One run starts a private redis-server on loopback with the production settings (AOF on,
appendfsync everysec, noeviction), measures, and stops it. Client work runs in this one Python
process (producer and consumer share it), so rlfleet and its peer see the same host and server:

1. latency, one batch in flight, the three paths interleaved sample by sample (rotating order):
   - rlfleet: `wire.rollout_to_proto(...).SerializeToString()` -> `Bus.publish` -> `Bus.read`
     (consumer group) -> `wire.parse_message` + `validate_rollout_batch` -> `Bus.ack`;
     latency is publish start (encode included) to the decoded `Rollout`;
   - raw redis-py, sync and asyncio clients: XADD / XREADGROUP / XACK of the same bytes,
     serialized once; latency is XADD start to the bytes in hand (the floor);
2. throughput, K batches in flight (producer and consumer tasks; the sync client pipelines windows
   of K): batches/s and MB/s, the paths taking turns over several passes, median over passes;
3. the codec alone (encode, decode + validate; no Redis);
4. the tiny CPU run (examples/tiny-cpu.yaml): its PromptBatch, RolloutBatch and ScoreBatch (per
   stage) through the full rlfleet path, plus raw redis-py hops of the same RolloutBatch bytes,
   added up to the deliveries of one training step and compared with the step time of the local
   loop (`services.local.run_local` for a few steps in a child process, with a time limit).

    python -m bench.data_plane [--quick] [--out bench/results/data_plane-<stamp>.json]

Medians everywhere (p99 of 50 samples is close to the maximum); every sample, the config, the host
and how busy its CPUs were with other processes go to the JSON file. On a shared host pass
`--wait-quiet SECONDS`; the report warns when other processes competed for the CPUs.

The package: `config` (what a run measures), `batches` (the synthetic RolloutBatch and its codec),
`hops` (one message through each path), the phases (`latency`, `throughput`, `tiny`, `local_loop`),
`host`, `stats`, `run` (one run, start to results), `report` (the terminal report) and `cli`.
"""
