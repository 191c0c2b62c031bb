"""Chat prompts: the SmolLM2 draft's training set and a held-out set with disjoint topics (also `bench --chat`).

Prompts are (template x topic) products; the held-out topics and two held-out templates never occur in training,
so acceptance measured on them is on prompts the draft has not seen.
"""

from __future__ import annotations

import random

TRAIN_TOPICS = """
photosynthesis; the water cycle; black holes; volcanoes; earthquakes; the French Revolution; the Roman Empire;
ancient Egypt; the printing press; the internet; electric cars; solar panels; wind turbines; climate change;
recycling; honey bees; dolphins; elephants; cats; dogs; sleep; exercise; healthy breakfast; coffee; tea;
chocolate; bread baking; pizza; sushi; gardening; tomatoes; houseplants; the moon; Mars; the solar system; gravity;
magnets; electricity; batteries; computers; smartphones; video games; chess; football; basketball; the Olympic
Games; music; the piano; the guitar; jazz; painting; Leonardo da Vinci; Shakespeare; poetry; libraries; reading;
learning a language; mathematics; prime numbers; fractions; geometry; algebra; statistics; budgeting; saving money;
job interviews; writing a resume; time management; public speaking; friendship; kindness; teamwork; leadership;
volunteering; rainforests; deserts; oceans; coral reefs; mountains; rivers; weather; hurricanes; snow; the seasons;
birds; butterflies; dinosaurs; evolution; DNA; vaccines; the human heart; the brain; vitamins; drinking water;
bicycles; trains; airplanes; ships; bridges; skyscrapers; the pyramids; castles; knights; pirates; space travel;
astronauts; robots; artificial intelligence; Python programming; sorting algorithms; databases; passwords;
email etiquette; social media; photography; movies; camping; hiking; fishing; the beach; birthdays; holidays;
cooking rice; making soup; salads; apples; bananas; milk; cheese; first aid; handwashing; stress; meditation;
happiness; habits; goal setting; the history of money; banks; taxes; democracy; elections; the United Nations;
maps; compasses; clocks; calendars; the alphabet; dictionaries; newspapers; radio; television
"""

HELD_OUT_TOPICS = """
penguins; the Great Wall of China; origami; lighthouses; glaciers; tigers; the violin; submarines; volleyball;
pancakes; the Renaissance; spiders; thunderstorms; Antarctica; carrots; owls; the stock market; the telephone;
bamboo; kangaroos; windmills; marathons; chemistry; the Amazon river
"""

# more unseen topics for the bench's open-chat workload only (`bench --workload chat`): enough that every batch size
# and repeat of a run up to B = 32 gets questions of its own (a suffix index must not meet a question it answered)
OPEN_CHAT_TOPICS = """
zebras; the Eiffel Tower; knitting; volcanic islands; octopuses; the accordion; canals; badminton; waffles;
the Industrial Revolution; ants; fog; the Sahara; potatoes; parrots; the bond market; the telegraph; cactuses;
koalas; water mills; triathlons; geology; the Nile; giraffes; the Colosseum; pottery; sand dunes; jellyfish;
the harp; tunnels; table tennis; crepes; the Bronze Age; beetles; rainbows; the Arctic; onions; eagles;
insurance; the typewriter; mushrooms; camels; steam engines; rowing; astronomy; the Danube; hedgehogs;
Stonehenge; calligraphy; caves; seahorses; the flute; lighthouse keepers; skiing; dumplings; the Vikings;
dragonflies; lightning; Greenland; garlic; hummingbirds; credit cards; the fax machine; moss; wolves;
hot air balloons; sailing; ecology; the Mississippi; flamingos; Machu Picchu; embroidery; waterfalls; starfish;
the drums; canal locks; fencing; porridge; the Silk Road; ladybugs; auroras; Iceland; peppers; swans; pensions;
the microscope; ferns; bears; cable cars; surfing; oceanography; the Thames; beavers; the Taj Mahal;
woodworking; hot springs; sea turtles; the cello; highways; archery; noodles; the Ming dynasty; crickets; tides;
Madagascar; lentils; herons; mortgages; the compass rose; lichens; foxes; gliders; kayaking; meteorology; the Rhine
"""

TRAIN_TEMPLATES = [
    "What is {t}?",
    "Explain {t} in simple terms.",
    "Explain {t} to a ten-year-old.",
    "Write a short paragraph about {t}.",
    "Give me three interesting facts about {t}.",
    "Write a short poem about {t}.",
    "What are the benefits of {t}?",
    "Why is {t} important?",
    "Write a short story about {t}.",
    "Summarize the history of {t}.",
    "List five things everyone should know about {t}.",
    "How does {t} work?",
    "What are common misconceptions about {t}?",
    "Write a haiku about {t}.",
    "Give me some tips related to {t}.",
    "Describe {t} in one paragraph.",
    "Can you tell me about {t}?",
    "What questions could a teacher ask about {t}?",
    "Compare {t} with something similar.",
    "Write a tweet about {t}.",
]

HELD_OUT_TEMPLATES = [
    "What is {t}?",
    "Explain {t} in simple terms.",
    "Write a short paragraph about {t}.",
    "Give me three interesting facts about {t}.",
    "How does {t} work?",
    "Why is {t} important?",
    "I am curious about {t}. What should I know?",   # template never seen in training
    "Teach me something new about {t}.",             # template never seen in training
]


def _topics(block: str) -> list[str]:
    return [t.strip() for t in block.replace("\n", " ").split(";") if t.strip()]


def train_prompts(seed: int = 0) -> list[str]:
    out = [tpl.format(t=t) for t in _topics(TRAIN_TOPICS) for tpl in TRAIN_TEMPLATES]
    random.Random(seed).shuffle(out)
    return out


def open_chat_prompts() -> list[str]:
    """The bench's open-chat questions: the held-out ones, then one per further unseen topic (templates cycling)."""
    topics = _topics(OPEN_CHAT_TOPICS)
    return held_out_prompts() + [HELD_OUT_TEMPLATES[i % len(HELD_OUT_TEMPLATES)].format(t=t)
                                 for i, t in enumerate(topics)]


def held_out_prompts() -> list[str]:
    topics = _topics(HELD_OUT_TOPICS)
    # one template per topic, cycling, so every template appears and the set stays small enough to evaluate
    return [HELD_OUT_TEMPLATES[i % len(HELD_OUT_TEMPLATES)].format(t=t) for i, t in enumerate(topics)]


assert not set(_topics(TRAIN_TOPICS)) & set(_topics(HELD_OUT_TOPICS) + _topics(OPEN_CHAT_TOPICS)), \
    "held-out topics must be unseen"
assert not set(_topics(HELD_OUT_TOPICS)) & set(_topics(OPEN_CHAT_TOPICS)), "each topic once"
