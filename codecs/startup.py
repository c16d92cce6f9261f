"""Start-up sizing of a streamed codec: the first chunk and hop growth that let playback started on the first chunk
never run dry, from the engine's frame pace and the codec's time per frame (codecs/decode_worker.py measures both)."""

from __future__ import annotations

from dataclasses import replace

from omnivox.codecs.streaming import StreamingOptions

START_MARGIN = 1.5  # start-up sized for rates this much worse than measured (1.2 ran dry ~20 ms in 1 of 3 streams)


def simulate_start(
    options: StreamingOptions, gen_s: float, codec_s: float, frame_s: float, horizon: int = 4
) -> tuple[float, float]:
    """(first audio, worst lateness) in seconds for one stream under `options`, with a frame generated every `gen_s`
    and a codec pass taking `codec_s` per decoded frame (its window, context included), one pass at a time.

    Chunk k (frames up to boundary b_k) is decoded once frames b_k + lookahead exist and the codec is free; playback
    starts when chunk 0 arrives and needs chunk k before the b_{k-1} frames ahead of it have played. Runs until
    `horizon` chunks after the hops reach hop_frames (beyond which, faster than real time, the buffer only grows).
    """
    lookahead, left = options.lookahead_frames, options.left_context_frames
    previous, codec_free, first, worst, at_max, k = 0, 0.0, 0.0, float("-inf"), 0, 0
    while at_max < horizon:
        hop = options.hop(k)
        at_max += hop == options.hop_frames
        boundary = previous + hop
        window = boundary + lookahead - max(0, previous - left)
        arrival = max((boundary + lookahead) * gen_s, codec_free) + window * codec_s
        codec_free = arrival
        if k == 0:
            first = arrival
        else:
            worst = max(worst, arrival - (first + previous * frame_s))
        previous, k = boundary, k + 1
    return first, worst


def startup_options(
    options: StreamingOptions,
    gen_s: float,
    codec_s: float,
    frame_s: float,
    margin: float = START_MARGIN,
    growths: tuple[float, ...] = (2.0, 1.5, 1.25),  # 1.25: half the first audio of 1.5 at 1 stream (gen 40 ms/frame)
) -> StreamingOptions:
    """The first chunk and hop growth that let playback started on the first chunk never run dry, at measured rates:
    a start-up buffer sized from the measured rate, as streaming players size theirs, held as the first chunk.

    With hops doubling from one frame, chunk 1 (2 frames) must be generated and decoded while chunk 0 (1 frame) plays;
    at two streams on this CPU it is not (benchmarks/speech.py: playback ran dry 1.1 s). So: among first hops in
    [options.first_hop_frames, hop_frames] and hop growths, the earliest first audio whose simulated playback
    (`simulate_start`, rates times `margin`) never runs dry. Where none does (slower than real time: playback will
    stall whatever the start), `options` as given: the earliest first audio. (Measured under heavy load, RTF 2-7:
    starting with a full hop there delayed first audio 0.8 -> 4.7 s and stalled as long.)
    """
    for b0 in range(options.first_hop_frames, options.hop_frames + 1):
        for growth in growths:
            sched = replace(options, first_hop_frames=b0, hop_growth=growth)
            if simulate_start(sched, gen_s * margin, codec_s * margin, frame_s)[1] <= 0:
                return sched  # the smallest first chunk that works: a larger one only delays the first audio
    return options
