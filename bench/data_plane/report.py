"""The report of a run, as the terminal shows it: the paths' latency and throughput, their ratios, the
codec's share, the tiny run's transport per step against its step time, and how busy the host was."""

from __future__ import annotations

from typing import Any

from bench.data_plane.config import MB, NOISY_HOST, PATH_LABELS, PATHS, TRANSPORT_TARGET


def format_report(res: dict[str, Any]) -> str:
    pay = res["payload"]
    host = res["host"]
    srv = res["redis"]
    lat = res["latency"]
    tp = res["throughput"]
    k = res["config"]["in_flight"]
    n = res["config"]["batches"]
    lines = [
        f"rlfleet data plane: {pay['seqs']} seqs x ({pay['prompt_len']} prompt"
        f" + {pay['response_len']} response)"
        f" tokens, {pay['bytes'] / MB:.2f} MB per RolloutBatch, N={n}",
        f"redis {srv['version']} loopback, appendonly={srv['appendonly']} appendfsync={srv['appendfsync']}"
        f" ({srv['data_dir_fs']}); {host['cpus_usable']} CPUs ({host['cpu_model']}); python {host['python']},"
        f" redis-py {host['redis_py']}, protobuf {host['protobuf']} ({host['protobuf_backend']})",
        "",
        f"{'path':<22}{'p50 ms':>9}{'p99 ms':>9}{'seq b/s':>9}{f'b/s K={k}':>10}{f'MB/s K={k}':>11}",
    ]
    for path in PATHS:
        lm = lat[path]["latency_ms"]
        t = tp[path]
        lines.append(f"{PATH_LABELS[path]:<22}{lm['p50']:>9.2f}{lm['p99']:>9.2f}"
                     f"{lat[path]['batches_per_s_sequential']:>9.1f}{t['batches_per_s']:>10.1f}{t['mb_per_s']:>11.0f}")
    parts = lat["rlfleet"]["parts_ms"]
    lines.append("rlfleet p50 parts: " + ", ".join(
        f"{p} {parts[p]['p50']:.2f}" for p in ("encode", "publish", "read", "decode", "ack")) + " ms")
    r = res["ratios"]
    codec = res["codec"]
    lines += [
        "",
        *(f"ratio rlfleet/{label + ':':<12} latency p50 {r[f'latency_p50_rlfleet_over_{peer}']:.2f}x,"
          f" p99 {r[f'latency_p99_rlfleet_over_{peer}']:.2f}x,"
          f" throughput {r[f'throughput_rlfleet_over_{peer}']:.2f}x"
          for peer, label in (("raw_sync", "raw-sync"), ("raw_async", "raw-asyncio"))),
        f"codec only (no Redis): encode {codec['encode_ms']['p50']:.2f}"
        f" + decode {codec['decode_ms']['p50']:.2f} ms"
        f" p50 = {r['codec_share_of_rlfleet_latency_p50']:.0%} of rlfleet p50 latency",
    ]
    tiny = res["tiny"]
    raw_hop = tiny["raw_rollout_hop_p50_ms"]
    ping = res["rtt"]["ping_ms"]
    d = tiny["deliveries_per_step"]
    hop = tiny["hop_p50_ms"]
    lines += [
        "",
        f"tiny run ({tiny['config']}: {tiny['seqs_per_message']} seqs/message, prompt {tiny['prompt_len']},"
        f" response {tiny['response_len']}, stages {'+'.join(tiny['stages'])}): hop p50 "
        + ", ".join(f"{name} {v:.2f} ms ({tiny['bytes'][name]:.0f} B)" for name, v in hop.items()),
        "  raw redis-py hop of the same RolloutBatch bytes: p50 "
        + ", ".join(f"{name.replace('_', '-')} {v:.2f} ms" for name, v in raw_hop.items())
        + f"; Redis round trip (PING) p50 sync {ping['sync']['p50'] * 1e3:.0f} us,"
          f" asyncio {ping['async']['p50'] * 1e3:.0f} us",
        f"  per step: {d['prompt']} prompt + {d['rollout']} rollout + {d['score']} score deliveries"
        f" = {tiny['transport_per_step_ms']:.1f} ms serial"
        f" ({tiny['transport_per_step_critical_ms']:.1f} ms if stages overlap);"
        f" raw-sync floor for the same deliveries {tiny['raw_floor_per_step_ms']['raw_sync']:.1f} ms",
    ]
    cmp_ = tiny["step_comparison"]
    if cmp_["status"] == "ok":
        verdict = "yes" if cmp_["meets_target"] else "NO"
        lines.append(f"  local-loop step p50 {cmp_['local_step_p50_ms']:.0f} ms -> transport adds"
                     f" {cmp_['transport_share']:.1%} (< {TRANSPORT_TARGET:.0%}: {verdict});"
                     f" {cmp_['transport_share_critical']:.1%} if stages overlap")
    else:
        lines.append(f"  local-loop step time: skipped: {cmp_['reason']}")
    lines.append(f"wall {res['wall_s']:.1f} s")
    phases = {"Redis phases": host.get("cpu_during_redis_phases"), "local loop": res["local_loop"].get("cpu")}
    for phase, cpu in phases.items():
        if not cpu:
            continue
        line = f"{phase}: host CPUs {cpu['busy']:.0%} busy"
        if "others" in cpu:
            line += (f" ({cpu['own']:.0%} ours, {cpu['others_user']:.0%} user time of other processes,"
                     f" kernel {cpu['kernel']:.0%} all told)")
        lines.append(line + f", steal {cpu['steal']:.1%}")
        if cpu.get("others_user", 0.0) > NOISY_HOST:
            lines.append(f"WARNING: other processes used the CPUs during the {phase}; rerun on a quiet host")
    return "\n".join(lines)
