#!/usr/bin/env python3
"""How evenly the Hopper forward's static schedule spreads a uniform call over the SMs.

The forward is persistent: CTA c takes items c, then 2g - 1 - c, ... (g CTAs, zig-zag
rounds; fwd_scheduler.cuh), an item being a pair of query tiles of one head (tile
q_tiles - 1 - j, then j). This script replays that walk on the host with a tile's cost
taken as the key tiles it visits, and prints the busiest SM's load over the mean (1.0:
perfect balance; the kernel's time follows the busiest SM), next to:
  paired    the middle tiles of heads 2m and 2m + 1 as one item where q_tiles is odd
            (TileSchedule::middles_paired: the static schedules);
  dynamic   the dynamic schedule (TileSchedule::dynamic: head dim 64 with a window,
            causal included, and sliding windows at head dims up to 128):
            single tiles from an atomic counter, heaviest first within sections of heads
            whose keys and values fill half of L2 (--l2-mb; the remainder section first),
            each SM taking its next tile as it finishes one (list scheduling: the
            producer takes it a K/V stage or two before the consumers finish);
  lpt       a lower bound for any schedule of whole tiles: longest-first list scheduling
            of single tiles (ignoring L2 locality and per-item costs).
No GPU needed:

    tools/schedule_balance.py [--sms 132]                   # the FA3-paper shapes
    tools/schedule_balance.py --seqlen S --head-dim D --heads H [--causal] [--window W]
"""

import argparse
import heapq
import math


def tile_rows(head_dim):
    """Query rows and keys of a forward tile (fwd_tile_config.h)."""
    return (192 if head_dim == 64 else 128), (128 if head_dim <= 128 else 64)


def tile_costs(seqlen, head_dim, causal, window):
    """Key tiles each query tile visits (query and key lengths equal, bottom-right)."""
    block_m, block_n = tile_rows(head_dim)
    costs = []
    for t in range(math.ceil(seqlen / block_m)):
        first, last = t * block_m, min(seqlen, (t + 1) * block_m) - 1
        key_end = last + 1 if causal else seqlen
        key_begin = max(0, first - window) if window is not None else 0
        costs.append(math.ceil(key_end / block_n) - key_begin // block_n)
    return costs


def items(costs, heads, sms, paired_middles):
    """The schedule's items in order, each the summed cost of its tiles."""
    q, half = len(costs), len(costs) // 2
    pairs = [costs[q - 1 - j] + (costs[j] if q - 1 - j != j else 0) for j in range((q + 1) // 2)]
    unpaired = len(pairs) * heads
    if not (paired_middles and q % 2 == 1 and heads > 1 and unpaired > sms):
        return pairs * heads
    out = []
    for first in range(0, heads, 2):
        both = first + 1 < heads
        out += pairs[:half] * (2 if both else 1) + [costs[half] * (2 if both else 1)]
    return out


def busiest_over_mean(item_costs, sms):
    """Zig-zag rounds (scheduled_item in fwd_scheduler.cuh)."""
    load = [0] * sms
    for i, cost in enumerate(item_costs):
        rnd, pos = divmod(i, sms)
        load[sms - 1 - pos if rnd % 2 else pos] += cost
    return max(load) * sms / sum(item_costs)


def list_schedule(order, sms):
    """Each tile of `order` to the SM that finishes first (a dynamic scheduler's walk)."""
    finish = [(0, s) for s in range(sms)]
    for cost in order:
        least, s = heapq.heappop(finish)
        heapq.heappush(finish, (least + cost, s))
    return max(f for f, _ in finish) * sms / sum(order)


def lpt_bound(costs, heads, sms):
    return list_schedule(sorted(costs * heads, reverse=True), sms)


def section_heads(seqlen, head_dim, heads, window, l2_mb, element_bytes=2):
    """fwd_launch_bucket.cuh's section_heads (no GQA: a group's heads share K and V)."""
    keys = seqlen if window is None else min(seqlen, window + tile_rows(head_dim)[0])
    return max(1, min(heads, int(l2_mb * 2**20 / 2) // (keys * 2 * head_dim * element_bytes)))


def dynamic(costs, heads, sms, section):
    """Tiles in the dynamic order (heaviest first: costs grow with the tile index under a
    causal mask), each SM taking the next as it finishes one."""
    q, remainder = len(costs), heads % section
    sizes = ([remainder] if remainder else []) + [section] * (heads // section)
    return list_schedule([costs[q - 1 - rank] for size in sizes for rank in range(q)
                          for _ in range(size)], sms)


def fa3_shapes():
    """FlashAttention-3's paper shapes (16k tokens, heads x head dim = 2048), GQA, window."""
    for d in (64, 128, 256):
        for s in (2048, 8192, 16384):
            for causal in (True, False):
                yield f"d{d} {s // 1024}k {'causal' if causal else 'full'}", s, d, 16384 // s * 2048 // d, causal, None
    yield "gqa32/8 d128 8k causal", 8192, 128, 2 * 32, True, None
    yield "window (1024, 0) d128 16k", 16384, 128, 16, True, 1024


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sms", type=int, default=132, help="CTAs of the persistent grid (SMs)")
    ap.add_argument("--seqlen", type=int, help="one call's shape (else the FA3-paper shapes)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--heads", type=int, help="batch x query heads (kv heads when GQA-packed)")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--window", type=int, help="left window (with --causal)")
    ap.add_argument("--l2-mb", type=float, default=50, help="L2 cache (H100: 50 MB)")
    a = ap.parse_args()
    shapes = (list(fa3_shapes()) if a.seqlen is None else
              [("this call", a.seqlen, a.head_dim, a.heads or 1, a.causal, a.window)])
    print(f"{'shape':28s} {'q_tiles':>7s} {'items':>6s} {'today':>6s} {'paired':>6s} {'dynamic':>7s} "
          f"{'(heads)':>7s} {'lpt':>6s}")
    for name, seqlen, d, heads, causal, window in shapes:
        costs = tile_costs(seqlen, d, causal, window)
        today = items(costs, heads, a.sms, False)
        print(f"{name:28s} {len(costs):7d} {len(today):6d} {busiest_over_mean(today, a.sms):6.3f} "
              f"{busiest_over_mean(items(costs, heads, a.sms, True), a.sms):6.3f} ", end="")
        if (causal or window is not None) and d <= 128:  # (fwd_launch_bucket.cuh)
            section = section_heads(seqlen, d, heads, window, a.l2_mb)
            print(f"{dynamic(costs, heads, a.sms, section):7.3f} {section:7d} ", end="")
        else:
            print(f"{'-':>7s} {'-':>7s} ", end="")
        print(f"{lpt_bound(costs, heads, a.sms):6.3f}")


if __name__ == "__main__":
    main()
