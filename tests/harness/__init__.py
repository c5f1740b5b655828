"""Shared test harness: the JAX reference oracle and deterministic test audio.

Import as `from harness import reference` and `from harness.audio import clip_set, speech`
(tests/conftest.py puts tests/ on sys.path). reference.py imports jax and needle, so import it
only where the reference is needed, or take the `reference` / `tiny_model` / `odd_model` /
`full_model` fixtures, which skip cleanly without it.

reference.py
    SHAPES, shape_config(shape)       "tiny", "odd", "full" WhistleConfigs (float32, 512-piece text vocab)
    build_model(shape, seed=0)        RefModel(cfg, params, qparams, path (.cact), tokenizer_model, sp), cached
    ladder(model, depth)              decoder cut to a ladder rung, with its own .cact
    reference_sanitize(pcm)           guide §3 step 1 (NaN / inf / |x| >= 65536 -> 0)
    reference_level(pcm)              guide §3 step 2 level gain
    ref_embed(model, pcm)             (frames, dim) quantised encoder output
    ref_logits(model, pcm, tokens)    (len(tokens), vocab) teacher-forced logits, tokens start with <s>
    ref_margins(model, pcm, tokens)   top-1 minus top-2 logit per position (to excuse near ties)
    ref_greedy(model, pcm, language)  (language, ids)
    ref_beam(model, pcm, language)    (language, ids); rules in beam_search's docstring
    beam_search(next_logits, ...)     the same search over any logits callback (toy-testable)
    find_loop(ids)                    guide §6 loop rule
audio.py
    speech(text, engine, voice, rate), speech_of_length(samples, engine), white_noise(seconds, dbfs),
    with_bad_samples(pcm), clip_set()
"""
