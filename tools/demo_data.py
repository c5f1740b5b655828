"""Synthetic speech for the bundled demo model: a seeded sentence grammar, TTS voices, augmentation.

Sentences sound like what people say to a captioning or voice-command service (timers, lights,
calls, music, reminders, weather, numbers, dates, short everyday sentences). Audio comes from
`espeak-ng` and `flite`, resampled to 16 kHz, with random gain, leading/trailing silence and
additive noise. Everything is a pure function of a seed, so the held-out test split can be
regenerated anywhere the two synthesisers are installed:

    from tools.demo_data import test_clips, make_clip
    clips = test_clips(200, seed=0)             # [(float32 16 kHz audio, text), ...]
    audio = make_clip("Call mom.", "espeak-ng/en-us+f2", seed=7)

The test split uses sentences never produced for training and voices never used in training
(`TEST_VOICES`). Command line: `python tools/demo_data.py --seed 0 --clips 5000 --out work-data/demo`
writes WAV files and `train.jsonl`, `validation.jsonl`, `test.jsonl` manifests (audio, text, voice, seed).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import wave
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from functools import cached_property, lru_cache

import numpy as np
import soxr

RATE = 16000  # Hz, the model's sample rate

# ---------------------------------------------------------------------------------------------
# Grammar

_ONES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
         "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
         "nineteen"]
_TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
_ORDINAL_IRREGULAR = {"one": "first", "two": "second", "three": "third", "five": "fifth",
                      "eight": "eighth", "nine": "ninth", "twelve": "twelfth"}


def number_words(n: int) -> str:
    """0..1000 as English words: 42 -> "forty-two", 305 -> "three hundred and five"."""
    if not 0 <= n <= 1000:
        raise ValueError(f"number_words takes 0..1000, got {n}")
    if n == 1000:
        return "one thousand"
    if n < 20:
        return _ONES[n]
    if n < 100:
        tens, ones = divmod(n, 10)
        return _TENS[tens] + ("-" + _ONES[ones] if ones else "")
    hundreds, rest = divmod(n, 100)
    head = _ONES[hundreds] + " hundred"
    return head + (" and " + number_words(rest) if rest else "")


def ordinal_words(n: int) -> str:
    """1..100 as an ordinal: 1 -> "first", 23 -> "twenty-third", 40 -> "fortieth"."""
    if not 1 <= n <= 100:
        raise ValueError(f"ordinal_words takes 1..100, got {n}")
    words = number_words(n)
    head, _, last = words.rpartition("-") if "-" in words else words.rpartition(" ")
    sep = "-" if "-" in words else " "
    if last in _ORDINAL_IRREGULAR:
        last = _ORDINAL_IRREGULAR[last]
    elif last.endswith("y"):
        last = last[:-1] + "ieth"
    else:
        last = last + "th"
    return (head + sep + last) if head else last


DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December"]
COLOURS = ["red", "green", "blue", "yellow", "orange", "purple", "pink", "white", "black", "brown",
           "grey", "gold", "silver", "teal", "violet"]
ROOMS = ["kitchen", "living room", "bedroom", "bathroom", "hallway", "garage", "office", "dining room",
         "basement", "garden", "nursery", "attic", "porch", "study", "guest room"]
DEVICES = ["lights", "fan", "heater", "radio", "television", "lamp", "oven", "kettle", "dishwasher",
           "washing machine", "air conditioner", "coffee maker", "speaker", "printer", "alarm"]
CONTACTS = ["mom", "dad", "grandma", "grandpa", "my sister", "my brother", "the office", "the doctor",
            "Anna", "Ben", "Carlos", "Diana", "Emma", "Frank", "George", "Hannah", "Isaac", "Julia",
            "Kevin", "Laura", "Michael", "Nora", "Oliver", "Peter", "Rachel", "Sarah", "Thomas", "Victor"]
GENRES = ["jazz", "rock", "classical music", "pop", "blues", "country music", "reggae", "hip hop",
          "folk music", "soul", "piano music", "the news", "a podcast", "relaxing music", "dance music"]
CITIES = ["London", "Paris", "Berlin", "Madrid", "Rome", "Tokyo", "Sydney", "Chicago", "Boston",
          "Toronto", "Dublin", "Seattle", "Denver", "Miami", "Austin", "Vienna", "Oslo", "Lisbon"]
TASKS = ["buy milk", "call the dentist", "water the plants", "take out the trash", "pay the rent",
         "pick up the kids", "feed the cat", "walk the dog", "send the report", "book a table",
         "clean the kitchen", "check the mail", "wash the car", "bring an umbrella", "charge my phone",
         "renew my passport", "order more coffee", "return the library books", "fix the bike",
         "pack my lunch", "drink some water", "stretch my legs", "lock the front door",
         "turn off the oven", "email my boss", "bake a cake", "buy some bread", "visit grandma"]
FOODS = ["apples", "bananas", "bread", "butter", "cheese", "chicken", "coffee", "eggs", "fish",
         "flour", "grapes", "honey", "juice", "lemons", "milk", "noodles", "oranges", "pasta",
         "pepper", "potatoes", "rice", "salt", "soup", "sugar", "tea", "tomatoes", "yogurt", "carrots",
         "onions", "cookies"]
UNITS = [("second", "seconds"), ("minute", "minutes"), ("hour", "hours")]
PLACES = ["the station", "the airport", "the nearest pharmacy", "the supermarket", "the park",
          "the hospital", "the museum", "the library", "the beach", "the city centre", "work", "home",
          "the gym", "the post office", "school"]
PEOPLE = ["I", "we", "they", "you"]
ADJECTIVES = ["cold", "warm", "sunny", "cloudy", "windy", "quiet", "busy", "late", "early", "tired",
              "happy", "hungry", "ready", "sorry", "great", "fine", "nice", "long", "short", "new"]
# Short everyday sentences, each with a slot or two, so that a sentence the test pool reserves is
# a new combination of words and phrasings heard in training, never a word training lacks (the
# fixed sentences of runs up to 19 took their words into the test pool with them). A slot lists
# its options; the first option of each slot gives the sentence's plain form (`EVERYDAY`).
_EVERYDAY_FORMS = [
    ("Good {}.", ["morning", "night", "afternoon", "evening"]),
    ("Thank you {}.", ["very much", "so much", "for calling", "for the coffee", "for your help"]),
    ("How are you {}?", ["today", "tonight", "this morning", "doing"]),
    ("I am on my way {}.", ["home", "to work", "to the station", "to the airport", "to school"]),
    ("See you {}.", ["tomorrow", "tonight", "next week", "later", "soon", "on Monday"]),
    ("What time is it {}?", ["now", "in London", "in Tokyo", "in Sydney"]),
    ("Where are my {}?", ["keys", "glasses", "shoes", "headphones", "gloves"]),
    ("Can you hear me {}?", ["now", "clearly", "at all"]),
    ("Please speak a little {}.", ["slower", "louder", "faster", "quieter"]),
    ("The {} starts {}.", ["meeting", "movie", "class", "game", "party"], ["soon", "at noon", "in ten minutes", "now"]),
    ("Let me think about {}.", ["it", "that", "the weekend", "dinner"]),
    ("That sounds like a {} idea.", ["good", "great", "nice", "bad"]),
    ("I will be there in {} minutes.", ["five", "ten", "twenty", "two"]),
    ("Could you repeat {}?", ["that", "the question", "the number", "the address"]),
    ("The {} is running {}.", ["train", "bus", "flight", "meeting"], ["late", "early"]),
    ("{} is ready.", ["Dinner", "Lunch", "Breakfast", "The coffee", "The car"]),
    ("I forgot my {} at {}.", ["wallet", "keys", "phone", "umbrella", "glasses"], ["home", "work", "the office", "the gym"]),
    ("Nice to {} you.", ["meet", "see", "hear from"]),
    ("Have a {} {}.", ["great", "nice", "quiet", "lovely"], ["weekend", "day", "evening", "trip"]),
    ("The weather is {} today.", ["lovely", "cold", "warm", "awful", "strange"]),
    ("I need a cup of {}.", ["coffee", "tea", "soup", "water"]),
    ("Please {} the {}.", ["close", "open"], ["window", "door", "gate", "curtains"]),
    ("Is anyone sitting {}?", ["here", "there", "next to you"]),
    ("The {} are {}.", ["children", "kids", "dogs", "guests"], ["asleep", "hungry", "ready", "outside"]),
    ("We should leave {}.", ["now", "soon", "early", "after lunch"]),
    ("My phone battery is {}.", ["low", "full", "dead", "charging"]),
    ("I can't find the {}.", ["remote", "keys", "charger", "car", "station"]),
    ("The {} closes at {}.", ["shop", "bank", "library", "museum", "pharmacy"], ["six", "five", "nine", "noon"]),
    ("Happy birthday to {}.", ["you", "mom", "dad", "Anna"]),
    ("It is raining {}.", ["again", "outside", "in London", "all day"]),
    ("Turn {} at the next {}.", ["left", "right"], ["corner", "light", "street", "junction"]),
    ("I will call you back {}.", ["later", "tomorrow", "tonight", "in five minutes"]),
    ("The {} is {}.", ["door", "window", "shop", "gate", "garage"], ["open", "closed", "locked"]),
    ("Do you want some {}?", ["tea", "coffee", "juice", "soup", "cake"]),
    ("Everything is {}.", ["fine", "ready", "great", "okay"]),
]
EVERYDAY = [form.format(*(options[0] for options in slots)) for form, *slots in _EVERYDAY_FORMS]


def everyday(rng: np.random.Generator) -> str:
    """A short everyday sentence: a form of `_EVERYDAY_FORMS` with each slot filled."""
    form, *slots = _pick(rng, _EVERYDAY_FORMS)
    return form.format(*(_pick(rng, options) for options in slots))


@lru_cache(maxsize=1)
def everyday_sentences() -> frozenset[str]:
    """Every sentence `everyday` can say."""
    from itertools import product
    return frozenset(form.format(*fill) for form, *slots in _EVERYDAY_FORMS for fill in product(*slots))


def _pick(rng: np.random.Generator, items):
    return items[int(rng.integers(len(items)))]


def _number(rng, low=0, high=1000) -> str:
    # Small numbers are said most often; draw half of them below twenty.
    n = int(rng.integers(low, min(high, 20) + 1)) if rng.random() < 0.5 and low < 20 else int(rng.integers(low, high + 1))
    return number_words(n)


def _time(rng) -> str:
    hour = number_words(int(rng.integers(1, 13)))
    minute = _pick(rng, ["o'clock", "fifteen", "thirty", "forty-five", "ten", "twenty", "five",
                         "oh five", "fifty"])
    if minute == "o'clock":
        return f"{hour} o'clock"
    return f"{hour} {minute}" + ("" if rng.random() < 0.5 else " " + _pick(rng, ["in the morning", "in the evening", "tonight"]))


def _date(rng) -> str:
    month = _pick(rng, MONTHS)
    day = ordinal_words(int(rng.integers(1, 32)))
    return f"{month} {day}" if rng.random() < 0.5 else f"the {day} of {month}"


def _decimal(rng) -> str:
    return f"{number_words(int(rng.integers(0, 100)))} point {number_words(int(rng.integers(0, 10)))}"


def _duration(rng) -> str:
    n = int(rng.integers(1, 61))
    single, plural = _pick(rng, UNITS)
    return f"{number_words(n)} {single if n == 1 else plural}"


def _when(rng) -> str:
    return _pick(rng, [
        lambda: f"at {_time(rng)}", lambda: f"on {_pick(rng, DAYS)}", lambda: "tomorrow",
        lambda: "tonight", lambda: f"on {_date(rng)}", lambda: f"in {_duration(rng)}",
        lambda: "next week", lambda: "this afternoon", lambda: f"next {_pick(rng, DAYS)}",
    ])()


def _cap(text: str) -> str:
    return text[0].upper() + text[1:]


_TEMPLATES = [
    lambda r: f"Set a timer for {_duration(r)}.",
    lambda r: f"Set an alarm for {_time(r)}.",
    lambda r: f"Wake me up {_when(r)}.",
    lambda r: f"Turn {_pick(r, ['on', 'off'])} the {_pick(r, DEVICES)} in the {_pick(r, ROOMS)}.",
    lambda r: f"Turn {_pick(r, ['on', 'off'])} the {_pick(r, DEVICES)}.",
    lambda r: f"Switch the {_pick(r, ROOMS)} lights to {_pick(r, COLOURS)}.",
    lambda r: f"Dim the lights in the {_pick(r, ROOMS)} to {number_words(int(r.integers(1, 101)))} percent.",
    lambda r: f"Set the temperature to {_number(r, 10, 30)} degrees.",
    lambda r: f"Call {_pick(r, CONTACTS)}.",
    lambda r: f"Call {_pick(r, CONTACTS)} {_when(r)}.",
    lambda r: f"Send a message to {_pick(r, CONTACTS)} saying {_lower_first(everyday(r)[:-1])}.",
    lambda r: f"Play some {_pick(r, GENRES)}.",
    lambda r: f"Play {_pick(r, GENRES)} in the {_pick(r, ROOMS)}.",
    lambda r: f"Turn the volume {_pick(r, ['up', 'down'])} to {_number(r, 1, 10)}.",
    lambda r: f"Skip to the {ordinal_words(int(r.integers(1, 21)))} song.",
    lambda r: f"Remind me to {_pick(r, TASKS)} {_when(r)}.",
    lambda r: f"Remind me to {_pick(r, TASKS)}.",
    lambda r: "What's the weather like" + _pick(r, ["", " today", " tomorrow", f" on {_pick(r, DAYS)}"])
              + _pick(r, ["", f" in {_pick(r, CITIES)}"]) + "?",
    lambda r: f"Will it rain in {_pick(r, CITIES)} {_pick(r, ['today', 'tomorrow', 'tonight', 'this weekend'])}?",
    lambda r: f"It is {_number(r, 0, 40)} degrees and {_pick(r, ADJECTIVES)} in {_pick(r, CITIES)}.",
    lambda r: f"What is {_number(r, 0, 100)} {_pick(r, ['plus', 'minus', 'times'])} {_number(r, 0, 100)}?",
    lambda r: f"The total is {_decimal(r)} dollars.",
    lambda r: f"Add {_number(r, 2, 12)} {_pick(r, FOODS)} to the shopping list.",
    lambda r: f"Add {_pick(r, FOODS)} and {_pick(r, FOODS)} to my list.",
    lambda r: f"How long does it take to get to {_pick(r, PLACES)}?",
    lambda r: f"Navigate to {_pick(r, PLACES)}.",
    lambda r: f"Schedule a meeting with {_pick(r, CONTACTS)} {_when(r)}.",
    lambda r: f"What day is {_date(r)}?",
    lambda r: f"My appointment is on {_pick(r, DAYS)} at {_time(r)}.",
    lambda r: f"The {_pick(r, ['bus', 'train', 'flight', 'meeting', 'movie', 'class'])} leaves at {_time(r)}.",
    lambda r: f"{_pick(r, PEOPLE)} will be {_pick(r, ADJECTIVES)} {_when(r)}.",
    lambda r: f"The {_pick(r, COLOURS)} car is parked near {_pick(r, PLACES)}.",
    lambda r: f"{_pick(r, ['Open', 'Close'])} the {_pick(r, ['front door', 'garage door', 'back door', 'curtains', 'blinds', 'window', 'gate', 'fridge'])}.",
    lambda r: f"Lock the {_pick(r, ['front door', 'back door', 'garage', 'car'])}.",
    lambda r: f"Room {_number(r, 1, 1000)} is on the {ordinal_words(int(r.integers(1, 31)))} floor.",
    lambda r: f"Set the oven to {_number(r, 100, 250)} degrees.",
    lambda r: f"Measure {_decimal(r)} {_pick(r, ['cups', 'grams', 'litres', 'inches', 'metres'])}.",
    lambda r: f"I was born on {_date(r)}.",
    lambda r: f"Today is {_pick(r, DAYS)}, {_date(r)}.",
    lambda r: f"{_pick(r, ['Stop', 'Pause', 'Start', 'Resume', 'Cancel', 'Restart'])} the "
              f"{_pick(r, ['timer', 'music', 'podcast', 'alarm', 'movie', 'song', 'video', 'stopwatch', 'news'])}.",
    lambda r: f"Cancel my {_ordinal_alarm(r)} {_pick(r, ['alarm', 'reminder', 'meeting', 'appointment'])}.",
    everyday,
    lambda r: f"I need {_pick(r, FOODS)} from the shop.",
    lambda r: f"We are meeting {_pick(r, CONTACTS)} at {_pick(r, PLACES)} {_when(r)}.",
    lambda r: f"The score is {_number(r, 0, 10)} to {_number(r, 0, 10)}.",
    lambda r: f"Page {_number(r, 1, 1000)}, line {_number(r, 1, 60)}.",
]


def _ordinal_alarm(rng) -> str:
    return ordinal_words(int(rng.integers(1, 11)))


def _lower_first(text: str) -> str:
    """'The door is open' -> 'the door is open' ('I', names and days keep their capitals)."""
    head, _, rest = text.partition(" ")
    keep = head == "I" or head in CONTACTS or head in DAYS or head in MONTHS or head in CITIES
    return (head if keep else head.lower()) + (" " + rest if rest else "")


def sentence(rng: np.random.Generator) -> str:
    """One sentence from the grammar, with normal casing and light punctuation."""
    text = _cap(_pick(rng, _TEMPLATES)(rng))
    return re.sub(r"\s+", " ", text).strip()


@lru_cache(maxsize=1)
def _probe_sentences() -> tuple[str, ...]:
    """20000 grammar sentences from a fixed seed: enough to meet every template and slot word."""
    probe = np.random.default_rng(12345)
    return tuple(sentence(probe) for _ in range(20000))


def grammar_vocabulary() -> set[str]:
    """Every lower-case word the grammar can produce (hyphenated numbers split at the hyphen)."""
    words: set[str] = set()
    sources = [number_words(n) for n in range(1001)] + [ordinal_words(n) for n in range(1, 101)]
    sources += DAYS + MONTHS + COLOURS + ROOMS + DEVICES + CONTACTS + GENRES + CITIES + TASKS
    sources += FOODS + PLACES + PEOPLE + ADJECTIVES + sorted(everyday_sentences()) + [w for pair in UNITS for w in pair]
    sources += _probe_sentences()
    for text in sources:
        words.update(_words(text))
    return words


def _words(text: str) -> list[str]:
    return [w for w in re.split(r"[^a-z']+", text.lower().replace("-", " ")) if w]


# ---------------------------------------------------------------------------------------------
# Voices and splits

ESPEAK_LANGS = ["en", "en-us", "en-gb-x-rp", "en-gb-scotland", "en-029", "en-gb-x-gbclan"]
ESPEAK_VARIANTS = ["m1", "m2", "m3", "m4", "m5", "m7", "f1", "f2", "f3", "f5", "f4", "m6"]
# espeak-ng's named speaker variants (pitch, formant and voicing settings of their own; the klatt
# ones use its Klatt synthesiser): more speakers to learn from, for `VoiceMix` "wide". Left out:
# effects rather than speakers (whisper, croak, robots, "Demonic", "Tweaky", announcer, fast) and
# "Mr serious" (a space in its name).
NAMED_VARIANTS = (
    "Alex", "Alicia", "Andrea", "Andy", "Annie", "AnxiousAndy", "Denis", "Diogo", "Gene", "Gene2",
    "Henrique", "Hugo", "Jacky", "Lee", "Marco", "Mario", "Michael", "Mike", "Nguyen", "RicishayMax",
    "Storm", "adam", "anika", "antonio", "aunty", "belinda", "benjamin", "boris", "caleb", "david",
    "ed", "edward", "edward2", "grandma", "grandpa", "gustave", "iven", "iven2", "iven3", "iven4",
    "john", "kaukovalta", "klatt", "klatt2", "klatt3", "klatt4", "klatt5", "klatt6", "linda", "m8",
    "marcelo", "max", "michel", "miguel", "norbert", "pablo", "paul", "pedro", "quincy", "rob",
    "robert", "sandro", "shelby", "steph", "steph2", "steph3", "travis", "victor", "zac")
FLITE_VOICES = ["kal", "kal16", "awb", "slt", "rms"]
# Debian's English festival voices (festvox-kallpc16k, festvox-kdlpc16k, festvox-us-slt-hts). kal and
# slt are speakers flite also has (a different synthesis of the same recordings); ked is not.
FESTIVAL_VOICES = ["kal_diphone", "ked_diphone", "cmu_us_slt_arctic_hts"]
# A synthesiser family: every voice one program speaks (the leave-one-family-out measure).
FAMILIES = {"espeak-ng": tuple(f"espeak-ng/{lang}+{v}" for lang in ESPEAK_LANGS for v in ESPEAK_VARIANTS)
            + tuple(f"espeak-ng/{lang}" for lang in ESPEAK_LANGS),
            "flite": tuple(f"flite/{v}" for v in FLITE_VOICES),
            "festival": tuple(f"festival/{v}" for v in FESTIVAL_VOICES)}
# Held out: every espeak-ng voice built on variants f4 and m6, and flite's rms.
HELD_OUT_VARIANTS = ("f4", "m6")
HELD_OUT_FLITE = ("rms",)

CORE_VOICES = tuple([f"espeak-ng/{lang}+{v}" for lang in ESPEAK_LANGS for v in ESPEAK_VARIANTS
                     if v not in HELD_OUT_VARIANTS] + [f"espeak-ng/{lang}" for lang in ESPEAK_LANGS]
                    + [f"flite/{v}" for v in FLITE_VOICES if v not in HELD_OUT_FLITE])
TRAIN_VOICES = CORE_VOICES + tuple(f"espeak-ng/{lang}+{v}" for lang in ESPEAK_LANGS for v in NAMED_VARIANTS)
TEST_VOICES = tuple([f"espeak-ng/{lang}+{v}" for lang in ESPEAK_LANGS for v in HELD_OUT_VARIANTS]
                    + [f"flite/{v}" for v in HELD_OUT_FLITE])


@dataclass(frozen=True)
class VoiceMix:
    """The training voices clips are drawn from: `voices`, each equally likely, or, with
    `flite_share`, flite's voices on that share of clips and espeak-ng's on the rest."""

    voices: tuple[str, ...]
    flite_share: float | None = None
    channel: float = 0.0  # share of clips played through a drawn room and channel (`channel()`)

    def __post_init__(self):
        if not self.voices:
            raise ValueError("a VoiceMix needs at least one voice")
        if self.flite_share is not None and not 0.0 <= self.flite_share <= 1.0:
            raise ValueError(f"flite_share is a share from 0 to 1 (or None), got {self.flite_share!r}")
        if not 0.0 <= self.channel <= 1.0:
            raise ValueError(f"channel is a share from 0 to 1, got {self.channel!r}")
        if self.flite_share is not None and not (self.flite and self.espeak):
            raise ValueError("a VoiceMix with a flite_share needs flite and espeak-ng voices both")

    @cached_property  # pick() reads it once per clip
    def espeak(self) -> tuple[str, ...]:
        return tuple(v for v in self.voices if v.startswith("espeak-ng/"))

    @cached_property  # pick() reads it once per clip
    def flite(self) -> tuple[str, ...]:
        return tuple(v for v in self.voices if v.startswith("flite/"))

    def pick(self, rng: np.random.Generator) -> str:
        if self.flite_share is None:
            return _pick(rng, self.voices)
        return _pick(rng, self.flite if rng.random() < self.flite_share else self.espeak)


# "core": the voices of the demo runs up to 13 (every voice equally likely: flite speaks 4 clips in 70).
# "wide": espeak-ng's named variants as well, and flite on a fifth of the clips (its held-out rms
# was the hardest test voice). "core-flite": the core voices, flite on a fifth of the clips.
# "broad": the wide voices, 70 % of clips through a drawn room and channel (reverberation,
# telephone band, microphone colouring; `channel()`), so that what does not matter varies. No
# festival voice: festival is the family the broad mix leaves out, to measure unseen voices on.
VOICE_MIXES = {"core": VoiceMix(CORE_VOICES), "wide": VoiceMix(TRAIN_VOICES, flite_share=0.2),
               "core-flite": VoiceMix(CORE_VOICES, flite_share=0.2),
               "broad": VoiceMix(TRAIN_VOICES, flite_share=0.2, channel=0.7)}
HELD_OUT = VoiceMix(TEST_VOICES)  # validation and test: every held-out voice equally likely


def voice_mix(name: str) -> VoiceMix:
    """VOICE_MIXES[name], with an error that lists the names."""
    if name not in VOICE_MIXES:
        raise ValueError(f"unknown voice mix {name!r}: expected one of {sorted(VOICE_MIXES)}")
    return VOICE_MIXES[name]


def _rng(seed: int, *labels) -> np.random.Generator:
    """A generator keyed by a seed and labels, independent of call order."""
    digest = hashlib.sha256(repr((int(seed),) + labels).encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little"))


def test_sentences(n: int, seed: int = 0) -> list[str]:
    """The first n distinct test sentences for a seed; training never sees them."""
    rng, out, seen = _rng(seed, "test-sentences"), [], set()
    while len(out) < n:
        text = sentence(rng)
        if text not in seen:
            seen.add(text)
            out.append(text)
    return out


TEST_POOL = 400  # sentences reserved for validation + test; test_clips(n) takes n <= TEST_POOL - VALIDATION
VALIDATION = 100


def _reserved(seed: int) -> set[str]:
    return set(test_sentences(TEST_POOL, seed))


def _fresh_sentence(source: np.random.Generator, reserved: set[str]) -> str:
    """The next sentence of `source` that is not reserved for testing."""
    while True:
        text = sentence(source)
        if text not in reserved:
            return text


def train_sentences(n: int, seed: int = 0) -> list[str]:
    """n training sentences (repeats allowed, as people repeat commands), none from the test pool."""
    rng, reserved = _rng(seed, "train-sentences"), _reserved(seed)
    return [_fresh_sentence(rng, reserved) for _ in range(n)]


def _items(texts, mix: VoiceMix, seed, label):
    rng = _rng(seed, label + "-voices")
    items = [{"text": t, "voice": mix.pick(rng),
              "seed": int(_rng(seed, label, i).integers(2 ** 31))} for i, t in enumerate(texts)]
    return _with_channel(items, mix, seed, label)


def _with_channel(items: list[dict], mix: VoiceMix, seed, label) -> list[dict]:
    """Marks mix.channel of the items `"channel": True` (drawn from a stream of their own, so the
    voices and seeds of a mix without channel draws are what they always were)."""
    if not mix.channel:
        return items
    draws = _rng(seed, label + "-channel").random(len(items))
    return [{**it, "channel": True} if d < mix.channel else it for it, d in zip(items, draws)]


def family_items(family: str, n: int, seed: int = 0) -> list[dict]:
    """The first n test sentences (`test_items`'s), spoken in turn by each voice of a synthesiser
    family (`FAMILIES`): what a model trained without that family is scored on."""
    if family not in FAMILIES:
        raise ValueError(f"unknown synthesiser family {family!r}: expected one of {sorted(FAMILIES)}")
    voices = FAMILIES[family]
    return [{**it, "voice": voices[i % len(voices)]} for i, it in enumerate(test_items(n, seed))]


def train_items(n: int, seed: int = 0, voices: str = "core") -> list[dict]:
    """n training clip specs {text, voice, seed}, voices drawn by VOICE_MIXES[voices]."""
    return _items(train_sentences(n, seed), voice_mix(voices), seed, "train")


def validation_items(n: int = VALIDATION, seed: int = 0) -> list[dict]:
    """Validation clip specs: held-out sentences (the last VALIDATION of the pool), held-out voices."""
    if not 1 <= n <= VALIDATION:
        raise ValueError(f"validation_items takes 1..{VALIDATION} clips, got {n}")
    return _items(test_sentences(TEST_POOL, seed)[-VALIDATION:][:n], HELD_OUT, seed, "validation")


def test_items(n: int, seed: int = 0) -> list[dict]:
    """The first n test clip specs {text, voice, seed}: unseen sentences spoken by unseen voices."""
    if not 1 <= n <= TEST_POOL - VALIDATION:
        raise ValueError(f"test_items takes 1..{TEST_POOL - VALIDATION} clips, got {n}")
    return _items(test_sentences(TEST_POOL, seed)[:n], HELD_OUT, seed, "test")


# ---------------------------------------------------------------------------------------------
# Synthesis and augmentation

def _read_wav(path: str) -> tuple[np.ndarray, int]:
    with wave.open(path, "rb") as w:
        rate, frames = w.getframerate(), w.readframes(w.getnframes())
        if w.getsampwidth() != 2 or w.getnchannels() != 1:
            raise RuntimeError(f"{path}: expected 16-bit mono, got {w.getsampwidth() * 8}-bit x{w.getnchannels()}")
    return np.frombuffer(frames, "<i2").astype(np.float32) / 32768.0, rate


def _espeak_cmd(text: str, name: str, speed: int, pitch: int, path: str) -> list[str]:
    """The espeak-ng command line that writes text to the WAV at path (synthesize, espeak_words)."""
    return ["espeak-ng", "-v", name, "-s", str(speed), "-p", str(pitch), "-w", path, text]


def synthesize(text: str, voice: str, rng: np.random.Generator) -> np.ndarray:
    """Speak text with a voice ("espeak-ng/en-us+f2" or "flite/slt"), float32 16 kHz.

    Speed and pitch are drawn from rng: espeak-ng 130-220 wpm, pitch 30-70; flite duration
    stretch 0.8-1.25 and a mean F0 shift of +-15 %; festival duration stretch 0.8-1.25.
    """
    engine, _, name = voice.partition("/")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "out.wav")
        if engine == "espeak-ng":
            speed, pitch = int(rng.integers(130, 221)), int(rng.integers(30, 71))
            cmd = _espeak_cmd(text, name, speed, pitch, path)
        elif engine == "flite":
            stretch, f0 = rng.uniform(0.8, 1.25), rng.uniform(0.85, 1.15)
            base_f0 = 170.0 if name == "slt" else 105.0
            cmd = ["flite", "-voice", name, "--setf", f"duration_stretch={stretch:.3f}",
                   "--setf", f"int_f0_target_mean={base_f0 * f0:.1f}", "-t", text, "-o", path]
        elif engine == "festival":
            if name not in FESTIVAL_VOICES:  # text2wave says nothing and writes nothing for these
                raise ValueError(f"unknown voice {voice!r}: festival's voices here are {FESTIVAL_VOICES}")
            stretch = rng.uniform(0.8, 1.25)
            script = os.path.join(tmp, "text.txt")
            with open(script, "w") as f:
                f.write(text)
            cmd = ["text2wave", "-eval", f"(voice_{name})", "-eval",
                   f"(Parameter.set 'Duration_Stretch {stretch:.3f})", "-o", path, script]
        else:
            raise ValueError(f"unknown voice {voice!r}: expected 'espeak-ng/<voice>', 'flite/<voice>' "
                             "or 'festival/<voice>'")
        subprocess.run(cmd, check=True, capture_output=True)
        audio, rate = _read_wav(path)
    if rate != RATE:
        audio = soxr.resample(audio, rate, RATE, quality="HQ").astype(np.float32)
    return audio


# Word start samples from libespeak-ng (the command line does not print them), run in a fresh
# process per sentence: the library keeps state between syntheses in one process (the second
# synthesis of a sentence differs from the first by a few samples), while a fresh process's first
# synthesis equals the `espeak-ng -w` output sample for sample (checked; the command line only adds
# ~0.28 s of near-silence at the end). argv: text, voice, speed, pitch; prints {"rate", "starts"}.
_WORD_STARTS = r"""
import ctypes, json, re, sys
text, name, speed, pitch = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
class Event(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("unique_identifier", ctypes.c_uint), ("text_position", ctypes.c_int),
                ("length", ctypes.c_int), ("audio_position", ctypes.c_int), ("sample", ctypes.c_int),
                ("user_data", ctypes.c_void_p), ("id", ctypes.c_char * 8)]
lib = ctypes.CDLL("libespeak-ng.so.1")
rate = lib.espeak_Initialize(2, 0, None, 0)  # AUDIO_OUTPUT_SYNCHRONOUS
events = []
def collect(wav, n, ev):
    i = 0
    while ev[i].type != 0:  # espeakEVENT_LIST_TERMINATED
        if ev[i].type == 1:  # espeakEVENT_WORD: 1-based character position, start sample
            events.append((ev[i].text_position - 1, ev[i].sample))
        i += 1
    return 0
callback = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int,
                            ctypes.POINTER(Event))(collect)
lib.espeak_SetSynthCallback(callback)
if rate <= 0 or lib.espeak_SetVoiceByName(name.encode()) != 0:
    sys.exit(f"espeak-ng cannot speak with voice {name!r}")
lib.espeak_SetParameter(1, speed, 0)  # espeakRATE
lib.espeak_SetParameter(3, pitch, 0)  # espeakPITCH
data = text.encode() + b"\0"
lib.espeak_Synth(data, len(data), 0, 1, 0, 1, None, None)  # POS_CHARACTER, espeakCHARS_UTF8
lib.espeak_Synchronize()
spans = [m.span() for m in re.finditer(r"\S+", text)]
starts = [-1] * len(spans)  # -1: a word espeak ran into its neighbour (no event of its own)
for pos, sample in events:
    for k, (a, b) in enumerate(spans):
        if a <= pos < b and starts[k] < 0:
            starts[k] = sample
print(json.dumps({"rate": rate, "starts": starts}))
"""


def _espeak_wav(text: str, name: str, speed: int, pitch: int) -> tuple[np.ndarray, int]:
    """(float32 audio, rate) of the `espeak-ng -w` output for text."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "out.wav")
        subprocess.run(_espeak_cmd(text, name, speed, pitch, path), check=True, capture_output=True)
        return _read_wav(path)


def espeak_words(text: str, name: str, speed: int, pitch: int) -> tuple[np.ndarray, int, list[int]]:
    """(float32 audio at espeak's rate, that rate, start sample of each whitespace-separated word).

    The audio is the `espeak-ng -w` output; a word espeak merged into its neighbour starts at -1.
    """
    found = subprocess.run([sys.executable, "-c", _WORD_STARTS, text, name, str(speed), str(pitch)],
                           check=True, capture_output=True, text=True)
    info = json.loads(found.stdout)
    audio, rate = _espeak_wav(text, name, speed, pitch)
    if rate != info["rate"]:
        raise RuntimeError(f"espeak-ng library rate {info['rate']} != command line rate {rate}")
    return audio, rate, info["starts"]


def add_noise(audio: np.ndarray, snr_db: float, rng: np.random.Generator) -> np.ndarray:
    """audio plus noise at snr_db relative to the power of the audio's non-silent part.

    The noise is white, pink-ish (one-pole low-passed) or brown (integrated), picked by rng.
    """
    speech = audio[np.abs(audio) > 1e-4]
    power = float(np.mean(speech.astype(np.float64) ** 2)) if len(speech) else 0.0
    if power == 0.0:
        return audio.copy()
    noise = rng.standard_normal(len(audio))
    kind = int(rng.integers(3))
    if kind == 1:
        noise = _one_pole(noise, 0.9)
    elif kind == 2:
        noise = _one_pole(noise, 0.995)
    noise -= noise.mean()
    noise *= np.sqrt(power / 10 ** (snr_db / 10) / np.mean(noise ** 2))
    return (audio + noise).astype(np.float32)


def _one_pole(x: np.ndarray, a: float) -> np.ndarray:
    from scipy.signal import lfilter  # tools only; the runtime package never imports scipy
    return lfilter([1.0], [1.0, -a], x)


def augment(audio: np.ndarray, rng: np.random.Generator, record: dict | None = None,
            trailing: bool = True, leading: bool = True) -> np.ndarray:
    """Leading/trailing silence 0.1-0.8 s, noise at 5-30 dB SNR (80 % of clips), gain -18..+6 dB.

    trailing=False keeps the end abrupt (a sentence prefix: what a streaming pass hears), and
    leading=False the start (a long-audio window that starts at a cut); the draws are the same
    either way. If record is a dict, the drawn lead/trail (seconds), snr_db (None when clean) and
    gain_db go in it.
    """
    lead, trail = rng.uniform(0.1, 0.8), rng.uniform(0.1, 0.8)
    lead, trail = (lead if leading else 0.0), (trail if trailing else 0.0)
    out = np.concatenate([np.zeros(int(lead * RATE), np.float32), audio, np.zeros(int(trail * RATE), np.float32)])
    snr_db = None
    if rng.random() < 0.8:
        snr_db = rng.uniform(5.0, 30.0)
        out = add_noise(out, snr_db, rng)
    gain_db = rng.uniform(-18.0, 6.0)
    out = out * 10 ** (gain_db / 20)
    peak = float(np.max(np.abs(out))) if len(out) else 0.0
    if record is not None:
        record.update(lead=lead, trail=trail, snr_db=snr_db, gain_db=gain_db)
    return (out / peak * 0.99 if peak > 0.99 else out).astype(np.float32)


def channel(audio: np.ndarray, rng: np.random.Generator, record: dict | None = None) -> np.ndarray:
    """Speech as a room, a line and a microphone pass it on, each drawn from rng (clean speech in,
    the same length out, float32 16 kHz):

    - reverberation (half the clips): a room impulse response of exponentially decaying noise after
      a direct path, RT60 0.15-0.9 s, direct-to-reverberant ratio 0-12 dB;
    - a telephone line (a quarter): 300-3400 Hz band, through 8 kHz, mu-law 8-bit on half of them;
    - microphone colouring (seven in ten): one peaking band of +-9 dB at 150-5000 Hz and a first
      order tilt (a high-pass at 60-400 Hz or a low-pass at 2.5-7 kHz).
    If record is a dict, what was drawn goes in it.
    """
    from scipy.signal import butter, fftconvolve, lfilter, sosfilt  # tools only

    drawn: dict = {}
    out = audio.astype(np.float64)
    if rng.random() < 0.5:
        rt60, drr_db = rng.uniform(0.15, 0.9), rng.uniform(0.0, 12.0)
        t = np.arange(int(rt60 * RATE)) / RATE
        tail = rng.standard_normal(len(t)) * np.exp(-6.9 * t / rt60)  # -60 dB at rt60
        tail *= np.sqrt(10 ** (-drr_db / 10) / np.sum(tail ** 2))
        rir = np.concatenate([[1.0], np.zeros(int(rng.integers(16, 160))), tail])
        out = fftconvolve(out, rir)[:len(out)]
        drawn.update(rt60=rt60, drr_db=drr_db)
    if rng.random() < 0.25:
        out = sosfilt(butter(6, [300, 3400], "bandpass", fs=RATE, output="sos"), out)
        narrow = soxr.resample(out, RATE, 8000, quality="HQ")
        if rng.random() < 0.5:
            peak = float(np.max(np.abs(narrow))) or 1.0
            mu = np.sign(narrow / peak) * np.log1p(255 * np.abs(narrow / peak)) / np.log1p(255)
            mu = np.round(mu * 127) / 127
            narrow = np.sign(mu) * np.expm1(np.abs(mu) * np.log1p(255)) / 255 * peak
            drawn["mu_law"] = True
        out = soxr.resample(narrow, 8000, RATE, quality="HQ")[:len(audio)]
        out = np.pad(out, (0, len(audio) - len(out)))
        drawn["telephone"] = True
    if rng.random() < 0.7:
        centre, gain_db, q = rng.uniform(150, 5000), rng.uniform(-9, 9), rng.uniform(0.7, 3.0)
        out = lfilter(*_peaking(centre, gain_db, q), out)
        if rng.random() < 0.5:
            corner = rng.uniform(60, 400)
            out = sosfilt(butter(1, corner, "highpass", fs=RATE, output="sos"), out)
        else:
            corner = rng.uniform(2500, 7000)
            out = sosfilt(butter(1, corner, "lowpass", fs=RATE, output="sos"), out)
        drawn.update(eq_hz=centre, eq_db=gain_db, tilt_hz=corner)
    if record is not None:
        record.update(drawn)
    peak = float(np.max(np.abs(out))) if len(out) else 0.0
    return (out / peak * 0.99 if peak > 0.99 else out).astype(np.float32)


def _peaking(centre: float, gain_db: float, q: float) -> tuple[np.ndarray, np.ndarray]:
    """(b, a) of the audio EQ cookbook's peaking biquad at 16 kHz."""
    a_gain, w0 = 10 ** (gain_db / 40), 2 * np.pi * centre / RATE
    alpha = np.sin(w0) / (2 * q)
    b = np.array([1 + alpha * a_gain, -2 * np.cos(w0), 1 - alpha * a_gain])
    a = np.array([1 + alpha / a_gain, -2 * np.cos(w0), 1 - alpha / a_gain])
    return b / a[0], a / a[0]


def _channelled(speech: np.ndarray, seed: int, wanted: bool) -> np.ndarray:
    """speech through the channel a clip's seed draws, when wanted. The channel draws from a stream
    of its own, so a clip with and without it shares every other draw."""
    return channel(speech, np.random.default_rng([int(seed), 0xC4A7])) if wanted else speech


def make_clip(text: str, voice: str, seed: int, with_channel: bool = False) -> np.ndarray:
    """One augmented clip: float32 mono at 16 kHz, a pure function of (text, voice, seed); with
    with_channel, played through a drawn room and channel (`channel()`) before the augmentation."""
    if not text.strip():
        raise ValueError("make_clip needs non-empty text")
    rng = np.random.default_rng(int(seed))
    return augment(_channelled(synthesize(text, voice, rng), seed, with_channel), rng)


def test_clips(n: int, seed: int = 0) -> list[tuple[np.ndarray, str]]:
    """The first n held-out test clips as (float32 16 kHz audio, text), regenerated from the seed."""
    return [(make_clip(it["text"], it["voice"], it["seed"]), it["text"]) for it in test_items(n, seed)]


# ---------------------------------------------------------------------------------------------
# Mixed training clips: sentence prefixes and several sentences in one clip

MAX_SECONDS = 29.5  # a mixed clip never exceeds one 30 s window


def mixed_items(n: int, seed: int = 0, prefix: float = 0.30, voices: str = "core") -> list[dict]:
    """n extra training clip specs, voices drawn by VOICE_MIXES[voices], from their own sentence
    stream (test pool removed).

    30 % (`prefix`) "prefix": a sentence cut in the first 40 % of a word (espeak-ng voices, whose
    word times we read), the transcript the words before that one, the end abrupt (no trailing silence): what
    a streaming pass hears mid-sentence. Complete clips always end in silence, so the model can
    tell the two apart and still finish whole sentences.
    55 % "multi": 2-4 sentences by one voice with 0.1-0.9 s pauses between them.
    15 % "long": sentences by one voice until an estimated 14-27 s: what a long-audio window holds.
    """
    if not 0.0 <= prefix <= 1.0:
        raise ValueError(f"prefix is the share of prefix clips, from 0 to 1; got {prefix!r}")
    rng, reserved = _rng(seed, "mixed"), _reserved(seed)
    source = _rng(seed, "mixed-sentences")

    def fresh() -> str:
        return _fresh_sentence(source, reserved)

    mix = voice_mix(voices)
    multi = prefix + (1.0 - prefix) * (0.55 / 0.70)  # multi : long stays 55 : 15
    items = []
    for i in range(n):
        r, seed_i = rng.random(), int(_rng(seed, "mixed", i).integers(2 ** 31))
        if r < prefix:
            text = fresh()
            while len(text.split()) < 2:
                text = fresh()
            keep = int(rng.integers(1, len(text.split())))
            items.append({"kind": "prefix", "source": text, "keep": keep, "voice": _pick(rng, mix.espeak),
                          "seed": seed_i})
            continue
        if r < multi:
            parts = [fresh() for _ in range(int(rng.integers(2, 5)))]
        else:
            target, parts, estimate = rng.uniform(14.0, 27.0), [], 0.0
            while estimate < target:
                parts.append(fresh())
                estimate += 0.36 * len(parts[-1].split()) + 0.8  # ~170 wpm plus the pause
        items.append({"kind": "multi" if r < multi else "long", "parts": parts,
                      "voice": mix.pick(rng), "seed": seed_i})
    return _with_channel(items, mix, seed, "mixed")


def window_items(n: int, seed: int = 0, voices: str = "core") -> list[dict]:
    """n training clip specs shaped like the 30 s windows long audio is read in (§8), voices drawn
    by VOICE_MIXES[voices], from their own sentence stream (test pool removed): sentences by one
    voice until an estimated 20-29 s. Half start at a cut ("head": mid-sentence at a word start for
    espeak-ng voices, whose word times we read; at a sentence start with no leading silence for the
    others), and 60 % end at one ("tail": inside a word of the last sentence, the transcript the words
    before it; after a sentence with no trailing silence for the others): what a window's edges hear
    when a clip runs on past them."""
    rng, reserved, mix = _rng(seed, "window"), _reserved(seed), voice_mix(voices)
    source = _rng(seed, "window-sentences")
    items = []
    for i in range(n):
        target, parts, estimate = rng.uniform(20.0, 29.0), [], 0.0
        while estimate < target:
            parts.append(_fresh_sentence(source, reserved))
            estimate += 0.36 * len(parts[-1].split()) + 0.8  # ~170 wpm plus the pause
        items.append({"kind": "window", "parts": parts, "voice": mix.pick(rng), "head": bool(rng.random() < 0.5),
                      "tail": bool(rng.random() < 0.6), "seed": int(_rng(seed, "window", i).integers(2 ** 31))})
    return _with_channel(items, mix, seed, "window")


def _window_clip(item: dict, rng: np.random.Generator) -> tuple[np.ndarray, str]:
    """make_mixed_clip for a window_items() spec."""
    engine, _, name = item["voice"].partition("/")
    timed = engine == "espeak-ng"
    speed, pitch = int(rng.integers(130, 221)), int(rng.integers(30, 71))  # one espeak-ng setting per clip

    def speak(part: str, with_starts: bool) -> tuple[np.ndarray, list[int] | None]:
        """16 kHz audio of part, and its word starts (samples, -1 where unknown) if with_starts."""
        if not timed:
            return synthesize(part, item["voice"], rng), None
        if with_starts:
            audio, rate, starts = espeak_words(part, name, speed, pitch)
        else:
            (audio, rate), starts = _espeak_wav(part, name, speed, pitch), None
        audio = soxr.resample(audio, rate, RATE, quality="HQ").astype(np.float32)
        return audio, None if starts is None else [int(x * RATE / rate) if x > 0 else -1 for x in starts]

    room = (MAX_SECONDS - (0.0 if item["head"] else 0.8) - (0.0 if item["tail"] else 0.8)) * RATE
    pieces, texts, total = [], [], 0
    last = len(item["parts"]) - 1
    for k, part in enumerate(item["parts"]):
        words = part.split()
        head = k == 0 and item["head"] and timed and len(words) > 1
        speech, starts = speak(part, head)
        if head:  # start at a word start inside the first sentence
            usable = [j for j in range(1, len(words)) if starts[j] > 0]
            if usable:
                j = usable[int(rng.integers(len(usable)))]
                speech, words = speech[starts[j]:], words[j:]
                starts = [x - starts[j] if x > 0 else -1 for x in starts[j:]]
        gap = np.zeros(int(rng.uniform(0.1, 0.9) * RATE), np.float32) if texts else np.zeros(0, np.float32)
        over = total + len(gap) + len(speech) > room
        if item["tail"] and timed and len(words) > 1 and (over or k == last):  # the window ends inside it
            if starts is None:
                speech, starts = speak(part, True)
            limit = room - total - len(gap)
            inside = [m for m in range(1, len(words)) if 0 < starts[m] < limit]
            if inside:
                keep = inside[-1] if over else inside[int(rng.integers(len(inside)))]
                nxt = next((x for x in starts[keep + 1:] if x > 0), len(speech))
                cut = starts[keep] + int(rng.uniform(0.0, 0.4) * (min(nxt, limit) - starts[keep]))
                pieces += [gap, speech[:cut]]
                texts.append(_prefix_text(words[:keep]))
                break
        if over:
            break
        pieces += [gap, speech]
        texts.append(" ".join(words))
        total += len(gap) + len(speech)
    audio = _channelled(np.concatenate(pieces), item["seed"], item.get("channel", False))
    return augment(audio, rng, trailing=not item["tail"], leading=not item["head"]), " ".join(texts)


def spliced_items(n: int, seed: int = 0, voices: str = "core") -> list[dict]:
    """n extra training clip specs, voices drawn by VOICE_MIXES[voices], from their own sentence
    stream (test pool removed): "spliced", a sentence spoken one word at a time (each word
    synthesised alone, its silence trimmed, 0.05-0.7 s of silence between words), as someone
    dictating word by word says it, and as the word-timestamp tests build their clips."""
    rng, reserved, mix = _rng(seed, "spliced"), _reserved(seed), voice_mix(voices)
    source = _rng(seed, "spliced-sentences")
    items = [{"kind": "spliced", "source": _fresh_sentence(source, reserved), "voice": mix.pick(rng),
              "seed": int(_rng(seed, "spliced", i).integers(2 ** 31))} for i in range(n)]
    return _with_channel(items, mix, seed, "spliced")


PAUSE_RANGE = (0.2, 1.5)  # seconds of silence a "paused" clip puts inside its sentence


def paused_items(n: int, seed: int = 0, voices: str = "core") -> list[dict]:
    """n extra training clip specs, voices drawn by VOICE_MIXES[voices], from their own sentence
    stream (test pool removed): speech as people pause in it.

    60 % "paused": a sentence cut at one or two word boundaries, each piece spoken by the same voice
    setting, PAUSE_RANGE seconds of silence between them; the transcript the whole sentence ("Set a
    timer for ... twelve minutes.").
    30 % "fragment": the first words of a sentence spoken alone, then silence; the transcript those
    words ("Set a timer for"): what a reader hears when the speaker stops mid-sentence.
    10 % "fragment" of one word: a word said alone is that word, not a sentence that holds it.
    """
    rng, reserved, mix = _rng(seed, "paused"), _reserved(seed), voice_mix(voices)
    source = _rng(seed, "paused-sentences")
    items = []
    for i in range(n):
        text = _fresh_sentence(source, reserved)
        while len(text.split()) < 2:
            text = _fresh_sentence(source, reserved)
        count, r = len(text.split()), rng.random()
        item = {"source": text, "voice": mix.pick(rng), "seed": int(_rng(seed, "paused", i).integers(2 ** 31))}
        if r < 0.6:
            cuts = rng.choice(np.arange(1, count), size=min(int(rng.integers(1, 3)), count - 1), replace=False)
            item.update(kind="paused", cuts=sorted(int(c) for c in cuts))
        else:
            item.update(kind="fragment", keep=1 if r >= 0.9 else int(rng.integers(1, count)))
        items.append(item)
    return _with_channel(items, mix, seed, "paused")


def _paused_clip(item: dict, rng: np.random.Generator) -> tuple[np.ndarray, str]:
    """make_mixed_clip for a paused_items() spec."""
    words = item["source"].split()
    voice_seed = int(rng.integers(2 ** 31))  # one speed and pitch for every piece of the clip
    if item["kind"] == "fragment":
        text = _prefix_text(words[:item["keep"]])
        speech = synthesize(text, item["voice"], np.random.default_rng(voice_seed))
        return augment(_channelled(speech, item["seed"], item.get("channel", False)), rng), text
    bounds = [0, *item["cuts"], len(words)]
    pieces = []
    for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
        speech = synthesize(" ".join(words[a:b]), item["voice"], np.random.default_rng(voice_seed))
        first, last = speech_span(speech)
        if k:
            pieces.append(np.zeros(int(rng.uniform(*PAUSE_RANGE) * RATE), np.float32))
        pieces.append(speech[first:last])
    audio = _channelled(np.concatenate(pieces), item["seed"], item.get("channel", False))
    return augment(audio, rng), item["source"]


@lru_cache(maxsize=1)
def _spellings() -> dict[str, str]:
    """Each grammar word (lower case, hyphenated numbers split) and how the grammar writes it inside
    a sentence: 'madrid' -> 'Madrid', 'i' -> 'I', 'lovely' -> 'lovely'."""
    seen: dict[str, dict[str, int]] = {}
    for text in _probe_sentences() + tuple(sorted(everyday_sentences())):
        for k, token in enumerate(re.split(r"[\s-]+", text)):
            token = token.strip(",.?!;:")
            if token and k:  # a sentence's first word is capitalised whatever it is
                counts = seen.setdefault(token.lower(), {})
                counts[token] = counts.get(token, 0) + 1
    out = {}
    for word in sorted(grammar_vocabulary()):
        forms = seen.get(word)
        out[word] = max(sorted(forms), key=forms.get) if forms else word
    out["i"] = "I"  # only ever sentence-initial in the grammar
    return out


def scrambled_items(n: int, seed: int = 0, voices: str = "core") -> list[dict]:
    """n extra training clip specs {text, voice, seed}: 3-8 words drawn uniformly from the grammar's
    vocabulary in no grammatical order ("Lovely Madrid seven kettle ready."), voices drawn by
    VOICE_MIXES[voices]. A model trained on grammar sentences alone learns the sentences: on a
    held-out sentence that the grammar states only once (an everyday sentence) it hears another
    sentence it knows. Words out of order make it listen to each word; no spec is a test sentence."""
    rng, reserved, mix = _rng(seed, "scrambled"), _reserved(seed), voice_mix(voices)
    spellings = _spellings()
    words = sorted(spellings)
    items = []
    while len(items) < n:
        picks = [spellings[words[int(k)]] for k in rng.integers(len(words), size=int(rng.integers(3, 9)))]
        text = _cap(" ".join(picks)) + "."
        voice = mix.pick(rng)
        if text not in reserved:
            items.append({"text": text, "voice": voice,
                          "seed": int(_rng(seed, "scrambled", len(items)).integers(2 ** 31))})
    return _with_channel(items, mix, seed, "scrambled")


def speech_span(audio: np.ndarray, floor_db: float = 40.0) -> tuple[int, int]:
    """First and last sample of the 30 ms frames within floor_db of the loudest one (a synthesised
    word without the silence around it); (0, 0) for silence."""
    frame = 480
    n = len(audio) // frame
    energy = np.sqrt((audio[: n * frame].reshape(n, frame).astype(np.float64) ** 2).mean(1))
    if not n or energy.max() <= 0.0:
        return 0, 0
    on = np.flatnonzero(energy > energy.max() * 10 ** (-floor_db / 20))
    return int(on[0]) * frame, (int(on[-1]) + 1) * frame


def word_by_word_clip(sentence: str, voice: str, seed: int, gaps: np.random.Generator,
                      lead_s: float = 0.5, pause_share: float = 1.0) -> tuple[np.ndarray, list[tuple[str, float, float]]]:
    """(16 kHz float32 audio, [(word, start_s, end_s)]): `sentence` spoken one word at a time, each
    word synthesised alone by `voice` (word j with seed + j) and cut to its speech_span, after
    lead_s of digital silence and each followed by 0.3-0.6 s of it (drawn from `gaps`). With
    pause_share < 1 only that share of words, drawn from `gaps`, is followed by silence; the others
    run straight into the next word. The spans are where each word's sound sits: the truth for
    word times."""
    if not 0.0 <= pause_share <= 1.0:
        raise ValueError(f"pause_share must be in [0, 1], got {pause_share}")
    parts, truth, t = [np.zeros(int(lead_s * RATE), np.float32)], [], int(lead_s * RATE)
    for j, word in enumerate(sentence.split()):
        audio = synthesize(word, voice, np.random.default_rng(seed + j))
        s, e = speech_span(audio)
        audio = audio[s:e]
        parts.append(audio)
        truth.append((word, t / RATE, (t + len(audio)) / RATE))
        t += len(audio)
        pause = pause_share >= 1.0 or gaps.random() < pause_share
        gap = int(gaps.uniform(0.3, 0.6) * RATE) if pause else 0
        parts.append(np.zeros(gap, np.float32))
        t += gap
    return np.concatenate(parts), truth


def _prefix_text(words: list[str]) -> str:
    return " ".join(words).rstrip(",;:")


def make_mixed_clip(item: dict, spans: list | None = None) -> tuple[np.ndarray, str]:
    """(augmented float32 16 kHz audio, transcript) for a mixed_items() spec.

    If spans is a list and the spec is "spliced", each whitespace word's [first, last + 1) sample
    in the returned audio is appended to it: where each separately synthesised word sits, which
    the training's alignment term (train_demo_model.py --align) teaches cross-attention to follow."""
    rng = np.random.default_rng(int(item["seed"]))
    if item["kind"] == "prefix":
        name = item["voice"].partition("/")[2]
        speed, pitch = int(rng.integers(130, 221)), int(rng.integers(30, 71))
        speech, rate, starts = espeak_words(item["source"], name, speed, pitch)
        words, keep = item["source"].split(), item["keep"]
        while keep < len(words) and starts[keep] <= 0:  # no usable boundary: cut at the next one
            keep += 1
        nxt = next((s for s in starts[keep + 1:] if s > 0), len(speech))
        cut = starts[keep] + int(rng.uniform(0.0, 0.4) * (nxt - starts[keep])) if keep < len(words) else len(speech)
        audio = _channelled(soxr.resample(speech[:cut], rate, RATE, quality="HQ").astype(np.float32), item["seed"],
                            item.get("channel", False))
        return augment(audio, rng, trailing=False), _prefix_text(words[:keep])
    if item["kind"] == "window":
        return _window_clip(item, rng)
    if item["kind"] in ("paused", "fragment"):
        return _paused_clip(item, rng)
    if item["kind"] == "spliced":
        voice_seed = int(rng.integers(2 ** 31))  # one speed and pitch for every word of the clip
        pieces, placed, at = [], [], 0
        for k, word in enumerate(item["source"].split()):
            speech = synthesize(word, item["voice"], np.random.default_rng(voice_seed))
            first, last = speech_span(speech)
            if k:
                pieces.append(np.zeros(int(rng.uniform(0.05, 0.7) * RATE), np.float32))
                at += len(pieces[-1])
            pieces.append(speech[first:last])
            placed.append((at, at + last - first))
            at += last - first
        drawn: dict = {}
        audio = augment(_channelled(np.concatenate(pieces), item["seed"], item.get("channel", False)), rng,
                        record=drawn)
        if spans is not None:
            lead = int(drawn["lead"] * RATE)  # augment's leading silence, as it cuts it
            spans += [(lead + a, lead + b) for a, b in placed]
        return audio, item["source"]
    pieces, texts, total = [], [], 0
    for k, part in enumerate(item["parts"]):
        speech = synthesize(part, item["voice"], rng)
        gap = np.zeros(int(rng.uniform(0.1, 0.9) * RATE), np.float32)
        if texts and total + len(speech) > (MAX_SECONDS - 1.7) * RATE:  # room for lead + trail
            break
        pieces += [gap, speech] if texts else [speech]
        texts.append(part)
        total += len(speech) + (len(gap) if k else 0)
    return augment(_channelled(np.concatenate(pieces), item["seed"], item.get("channel", False)), rng), " ".join(texts)


# ---------------------------------------------------------------------------------------------
# Writing a dataset

def _write_one(args) -> dict:
    item, path = args
    sidecar = path[:-4] + ".txt"  # a mixed clip's transcript, known only once it is synthesised
    timed = path[:-4] + ".words.json"  # a spliced clip's word spans (samples)
    spliced = item.get("kind") == "spliced"
    if spliced and os.path.exists(path) and not os.path.exists(timed):
        os.remove(path)  # synthesised before spans were kept: the clip is a pure function of its spec
    if not os.path.exists(path):
        if "kind" in item:
            spans: list = []
            audio, text = make_mixed_clip(item, spans)
            with open(sidecar, "w") as f:
                f.write(text)
            if spliced:
                with open(timed + ".tmp", "w") as f:
                    json.dump(spans, f)
                os.replace(timed + ".tmp", timed)
        else:
            audio = make_clip(item["text"], item["voice"], item["seed"], bool(item.get("channel")))
        pcm = np.clip(np.round(audio * 32767), -32768, 32767).astype("<i2")
        tmp = path + ".tmp"
        with wave.open(tmp, "wb") as w:
            w.setnchannels(1), w.setsampwidth(2), w.setframerate(RATE)
            w.writeframes(pcm.tobytes())
        os.replace(tmp, path)
    if "kind" in item:
        with open(sidecar) as f:
            item = {**item, "text": f.read()}
    if spliced:
        with open(timed) as f:
            item = {**item, "words": json.load(f)}
    with wave.open(path, "rb") as w:
        seconds = w.getnframes() / RATE
    return {**item, "audio": os.path.abspath(path), "seconds": round(seconds, 3)}


def write_split(items: list[dict], folder: str, name: str, workers: int = 2) -> str:
    """Synthesise items into folder/name/NNNNNN.wav and write folder/name.jsonl; returns its path."""
    os.makedirs(os.path.join(folder, name), exist_ok=True)
    jobs = [(it, os.path.join(folder, name, f"{i:06d}.wav")) for i, it in enumerate(items)]
    if workers <= 1:  # in this process: no fork (a test process may hold JAX's threads)
        rows = [_write_one(job) for job in jobs]
    else:
        with ProcessPoolExecutor(workers) as pool:
            rows = list(pool.map(_write_one, jobs, chunksize=16))
    manifest = os.path.join(folder, name + ".jsonl")
    with open(manifest + ".tmp", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    os.replace(manifest + ".tmp", manifest)
    return manifest


def read_wav16k(path: str) -> np.ndarray:
    """A 16 kHz 16-bit mono WAV as float32 in [-1, 1]."""
    audio, rate = _read_wav(path)
    if rate != RATE:
        raise ValueError(f"{path}: expected {RATE} Hz, got {rate}")
    return audio


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--clips", type=int, default=5000, help="training clips")
    ap.add_argument("--test", type=int, default=TEST_POOL - VALIDATION, help="test clips")
    ap.add_argument("--out", default="work-data/demo")
    args = ap.parse_args(argv)
    for name, items in (("test", test_items(args.test, args.seed)),
                        ("validation", validation_items(VALIDATION, args.seed)),
                        ("train", train_items(args.clips, args.seed))):
        print(name, write_split(items, args.out, name), flush=True)


if __name__ == "__main__":
    main()
