"""Open-chat seed prompts for distilling a head, beside bench/stdlib_prompts.py's code prompts: distinct
requests (575: stories, explanations, advice, recipes, letters, plans, comparisons, hypotheticals, ...) from
fixed topic lists, none of them one of the held-out open-chat prompts (bench/distill_smollm2.py OPEN_CHAT,
bench/workloads/chat.jsonl) nor one of specpack.distill.data.builtin_prompts(). Each list is paired with
its form once, so no two prompts differ by a single swapped word across a whole product of lists.

    python bench/chat_prompts.py > bench/seeds/open_chat.jsonl
"""
from __future__ import annotations

import json

CONCEPTS = """compound interest|the greenhouse effect|how a search engine ranks pages|what a mortgage is|
how noise-cancelling headphones work|what an API is|how the immune system fights a cold|what supply and demand means|
how a bill becomes a law|what a neural network is|how GPS finds your location|why bread rises|what a blockchain is|
how a microwave oven heats food|what the stock market is|how a rocket reaches orbit|what an index fund is|
why cats purr|how a vaccine trial works|what entropy is|how solar panels make electricity|what a credit score is|
how the heart pumps blood|why ice floats|what encryption is|how a camera lens focuses|what a recession is|
how plants know which way is up|what a time zone is|how a thermostat works|why the Moon has phases|
what an operating system does|how coral reefs form|what a placebo is|how hearing works|what a carbon footprint is|
how a car engine works|what quantum computing is|why we yawn|how a library catalogue works|what a tax return is|
how birds migrate|what a firewall is|how muscles grow|what the water cycle is|how recycling is sorted|
what a patent is|how wind turbines work|what an ecosystem is|why metal feels cold|how a touch screen works|
what cloud computing is|how glasses correct vision|what a jury does|how a dam generates power|
what the placebo effect is|how soap cleans|what a light-year is|how memory works in the brain|what a startup is"""
AUDIENCES = ["in simple terms", "to a ten-year-old", "in two paragraphs", "with an everyday example",
             "as if I were a complete beginner", "in three bullet points"]

PEOPLE = """a beekeeper|a lonely astronaut|a stubborn goat|a young pianist|a retired spy|a lighthouse cat|
a robot chef|a forgetful wizard|a street artist|a deep-sea diver|a tiny snail|a train conductor|a bored knight|
a village doctor|a runaway balloon|a grandmother who loves motorbikes|a shy ghost|a clever fox|a park ranger|
a mail carrier|an apprentice blacksmith|a penguin who hates the cold|a time-travelling historian|a night owl|
a circus acrobat|a kind giant|a nervous student|a librarian robot|a sailor|an old violin|a mountain goat|
a forgotten toy|a farmer's daughter|a painter who lost her colours|a city pigeon|a café owner"""
PLOTS = """on the first day of winter|during a power cut|at a busy train station|on a tiny island|in a floating city|
after a long storm|at the bottom of the sea|in a library at midnight|on the way to a wedding|in a desert town|
during a school play|on a rainy Monday|at the top of a mountain|in a snowed-in cabin|at a night market|
on a spaceship far from home|at a county fair|in a forest that moves|during a chess tournament|on a sinking boat"""
OPENINGS = ["The letter arrived ten years too late.", "Nobody in the village had ever seen the door open.",
            "It was the last bus of the night, and it was empty.", "The map was drawn on the back of a recipe.",
            "She woke up speaking a language she had never learned.", "The robot had one rule: never lie.",
            "Every clock in town stopped at 3:17.", "The old man planted a tree he would never see grow.",
            "The package was addressed to someone who had moved away fifty years ago.",
            "On Tuesdays, the river ran backwards.", "The phone rang in the empty house.",
            "He had one hour to return the dragon's egg.", "The new neighbours never turned on their lights.",
            "The painting changed a little every morning.", "It started with a single red balloon."]

DISHES = """a vegetable curry|banana bread|a quick tomato pasta|pancakes without eggs|a Greek salad|lentil soup|
homemade pizza dough|a simple stir-fry|guacamole|chocolate chip cookies|a mushroom risotto|fried rice|
overnight oats|a chickpea salad|roasted vegetables|a fruit smoothie|scrambled tofu|a potato gratin|
apple crumble|a bean chili|a cucumber raita|lemon garlic chicken|a spinach omelette|a peanut noodle bowl"""
SKILLS = """handwriting|typing speed|chess|memory|posture|time management|listening skills|drawing|singing voice|
sleep schedule|focus at work|cooking skills|spelling|mental maths|negotiation|public writing|leadership|
patience|confidence in meetings|piano practice|photography composition|chess endgames|essay structure|
small talk|decision making"""
CHOICES = """working from home|renting versus buying a home|electric cars|learning online|having a pet dog|
living in a big city|freelancing|a four-day work week|social media for teenagers|nuclear energy|
homeschooling|open-plan offices|buying a used car|studying abroad|cashless payments|a gap year|
a standing desk|self-driving cars|smart home devices|remote meetings|tiny houses|subscription services|
going vegetarian|early retirement|online dating"""
PLACES = """Lisbon|Kyoto|Iceland|the Scottish Highlands|Rome|Vancouver|Marrakech|Prague|New Zealand's South Island|
Buenos Aires|Istanbul|Copenhagen|the Grand Canyon|Seoul|Vienna|Cape Town|Barcelona|Hanoi|the Swiss Alps|
Edinburgh|Mexico City|Amsterdam|Sydney|Dublin|Budapest"""
DEVICES = """a bicycle gear|a smoke detector|a washing machine|an electric kettle|a zipper|a lock and key|
a mechanical watch|a flush toilet|a printer|a hearing aid|a wireless charger|a barcode scanner|an escalator|
a fridge's ice maker|an electric guitar pickup|a parachute|a fountain pen|a traffic light|a sewing machine|
a hot air balloon|a lightbulb|a speaker|a compass|a pressure cooker|a vending machine"""
PHENOMENA = """onions make us cry|leaves rustle in the wind|we get goosebumps|the sea has waves|cats land on their feet|
stars twinkle|our voices sound different on recordings|we get hiccups|popcorn pops|bubbles are round|
some people are left-handed|the sunset is red|dogs wag their tails|we feel dizzy after spinning|
hair turns grey|paper turns yellow with age|our ears pop on a plane|coffee keeps us awake|
the Moon looks bigger near the horizon|ice cream gives us brain freeze"""
WHAT_IFS = """the Moon disappeared|humans could photosynthesise|everyone spoke the same language|
the internet went down for a week|we could read minds|cars had never been invented|it rained every day for a year|
animals could talk|we only needed one hour of sleep|money did not exist|the oceans were fresh water|
people lived for three hundred years|there were no clocks|everyone worked from home forever|
the Earth spun twice as fast|we could breathe underwater|books were banned|dinosaurs still lived today|
electricity stopped working|every city was car-free"""
PROBLEMS = """traffic jams|food waste|air pollution|procrastination|burnout at work|loneliness in cities|
plastic in the oceans|rising rents|misinformation online|soil erosion|noise pollution|low voter turnout|
screen addiction|species extinction|water shortages|obesity|forest fires|youth unemployment|
cyberbullying|long hospital waiting times"""
EMAILS = [("my landlord", "a broken heater"), ("a teacher", "missing a class"), ("a colleague", "a project delay"),
          ("a hotel", "a lost jacket"), ("my manager", "asking for a day off"), ("a neighbour", "a noisy party"),
          ("a customer", "a late delivery"), ("a professor", "asking for a reference letter"),
          ("a friend", "congratulating them on a new job"), ("a company", "a refund for a faulty product"),
          ("a club", "joining as a new member"), ("a recruiter", "declining a job offer politely"),
          ("my team", "welcoming a new member"), ("a plumber", "scheduling a repair"),
          ("a bookshop", "ordering a rare book"), ("my gym", "cancelling a membership"),
          ("an old friend", "catching up after years"), ("a council", "a pothole on my street"),
          ("a journal editor", "submitting an article"), ("a wedding guest list", "a change of venue")]
NAMES = """a bakery|a goldfish|a hiking club|a podcast about history|a coffee shop|a fantasy kingdom|
a board game|a sailing boat|a robot vacuum|a book club|a food truck|a band that plays jazz|
a gardening app|a superhero|a pet tortoise|a new planet|a bookshop cafe|a youth football team|
a cooking blog|a children's toy"""
PRODUCTS = """a reusable water bottle|noise-cancelling earbuds|a handmade wooden chair|a solar-powered lamp|
a smart plant pot|a travel backpack|an ergonomic keyboard|a scented candle|a folding bicycle|a fitness tracker|
a ceramic teapot|a waterproof jacket|an electric toothbrush|a board game for families|a desk organiser|
a portable projector|a yoga mat|a coffee grinder|a children's picture book|a weekend pottery class"""
DECISIONS = """choosing a university|adopting a cat|buying a first car|starting a podcast|changing careers|
picking a mobile phone plan|moving to another country|hiring a first employee|choosing a wedding venue|
buying a house|starting a garden|picking a programming language to learn|booking a holiday|
going back to school|choosing a family doctor|opening a savings account|renovating a kitchen|
choosing running shoes|buying a laptop for a student|joining a startup"""
HISTORY = """the printing press|the bicycle|chess|the Olympic Games|coffee|the telephone|paper money|
the Great Wall of China|the piano|vaccines|the railway|the English language|tea ceremonies|the compass|
photography|the postal service|jeans|the calendar|pizza|the World Wide Web"""
DIALOGUES = [("a cat", "a dog", "who is the better pet"), ("a teacher", "a student", "homework"),
             ("the Sun", "the Moon", "who works harder"), ("a customer", "a waiter", "a wrong order"),
             ("two astronauts", "a mission control officer", "a strange signal"),
             ("a grandparent", "a grandchild", "smartphones"), ("a knight", "a dragon", "a peace treaty"),
             ("a coach", "a nervous player", "the final match"), ("a tourist", "a local", "directions"),
             ("a robot", "a child", "what friendship means"), ("a baker", "a food critic", "a burnt cake"),
             ("a detective", "a witness", "a missing painting"), ("two trees", "a woodcutter", "the forest"),
             ("a job applicant", "an interviewer", "a gap in a CV"), ("a pilot", "a passenger", "turbulence")]
POEMS = """a broken umbrella|the smell of rain|a lighthouse in fog|Monday mornings|an old photograph|a cup of tea|
growing older|a city at dawn|a paper boat|the last day of summer|a sleeping dog|the sound of a train|
a garden after rain|a long-distance friendship|the colour blue|a forgotten song|snow on rooftops|a candle|
the first day of school|an empty playground"""
GOALS = """losing weight|building strength|running a 10k|improving flexibility|a busy parent|a beginner over fifty|
training for a hike|better posture|home workouts without equipment|a desk worker with back pain|
swimming endurance|cycling to work|recovering from a long break|improving balance|a student with little time"""
MESSAGES = """a friend before an exam|a team after losing a match|someone starting a new job|
a nervous public speaker|a student who failed a test|a colleague going on maternity leave|a runner before a marathon|
someone moving to a new city|a volunteer group|a sibling graduating|a retiring teacher|
a child on their first day of school|
a friend recovering from illness|new employees|a team finishing a hard project"""
SUMMARIES = """the life of a honeybee|how the Internet grew|the causes of the First World War|the story of the Titanic|
the discovery of penicillin|the first Moon landing|the life of Marie Curie|the rise of smartphones|
the invention of writing|the fall of the Berlin Wall|the life cycle of a star|the history of the Olympics|
how the Panama Canal was built|the life of Leonardo da Vinci|the Industrial Revolution"""
ROUTINES = """a calm morning routine|a productive study session|a relaxing Sunday|a healthy evening routine|
a week of simple dinners|a birthday party for a six-year-old|a one-day visit to a museum|a team-building afternoon|
a picnic for four people|a rainy-day activity list for kids|a reading plan for a month|a budget weekend in the city|
a spring cleaning checklist|a packing list for camping|a new-employee first week"""
ANALOGIES = """the internet|a computer's memory|the economy|a cell|democracy|an orchestra|a database|
the immune system|a river delta|a compiler"""
COMPARE = [("a violin", "a viola"), ("a hurricane", "a tornado"), ("a latte", "a cappuccino"),
           ("a museum", "a gallery"), ("a crocodile's diet", "a shark's diet"), ("tennis", "badminton"),
           ("a novel", "a novella"), ("a credit card", "a debit card"), ("a rabbit", "a hare"),
           ("a sweet potato", "a yam"), ("a moth", "a butterfly"), ("a lake", "a reservoir"),
           ("a cold", "the flu"), ("a mortgage", "a loan"), ("a city", "a town"), ("a sea", "an ocean"),
           ("a lawyer", "a solicitor"), ("a jam", "a jelly"), ("a cello", "a double bass"), ("a wolf", "a coyote")]


def split(block: str) -> list[str]:
    return [s.strip() for s in block.split("|")]


def prompts() -> list[str]:
    """Every prompt, in a fixed order; each list is used by one or two forms."""
    concepts, people, plots = split(CONCEPTS), split(PEOPLE), split(PLOTS)
    out = [f"Explain {c} {AUDIENCES[i % len(AUDIENCES)]}." for i, c in enumerate(concepts)]
    out += [f"Tell me a short story about {p} {plots[i % len(plots)]}." for i, p in enumerate(people)]
    out += [f"Write a short story that begins with: \"{o}\"" for o in OPENINGS]
    out += [f"Give me a simple recipe for {d}." for d in split(DISHES)]
    out += [f"How can I improve my {s}?" for s in split(SKILLS)]
    out += [f"What are the pros and cons of {c}?" for c in split(CHOICES)]
    places = split(PLACES)
    out += [f"Plan a {2 + i % 4}-day trip to {p}." for i, p in enumerate(places)]
    out += [f"What should a first-time visitor know about {p}?" for p in places]
    out += [f"How does {d} work?" for d in split(DEVICES)]
    out += [f"Why do {p}?" if not p.startswith(("the", "some", "our", "hair", "paper", "coffee", "ice"))
            else f"Why is it that {p}?" for p in split(PHENOMENA)]
    out += [f"What would happen if {w}?" for w in split(WHAT_IFS)]
    problems = split(PROBLEMS)
    out += [f"What are the main causes of {p}?" for p in problems]
    out += [f"Suggest practical ways a town could reduce {p}." for p in problems]
    out += [f"Write a polite email to {to} about {about}." for to, about in EMAILS]
    out += [f"Suggest five names for {n}." for n in split(NAMES)]
    out += [f"Write a short product description for {p}." for p in split(PRODUCTS)]
    out += [f"What should I consider when {d}?" for d in split(DECISIONS)]
    out += [f"Give me a brief history of {h}." for h in split(HISTORY)]
    out += [f"Write a short dialogue between {a} and {b} about {t}." for a, b, t in DIALOGUES]
    poems = split(POEMS)
    out += [f"Write a poem about {p}." if i % 2 else f"Write a limerick about {p}." for i, p in enumerate(poems)]
    out += [f"Suggest a weekly workout plan for {g}." for g in split(GOALS)]
    out += [f"Write an encouraging message for {m}." for m in split(MESSAGES)]
    out += [f"Summarise {s} in a few sentences." for s in split(SUMMARIES)]
    out += [f"Help me plan {r}." for r in split(ROUTINES)]
    out += [f"Explain {a} using an analogy." for a in split(ANALOGIES)]
    out += [f"How is {a} different from {b}?" for a, b in COMPARE]
    out += [f"I am {s} and feel stuck. What small steps can I take?" for s in
            ("learning to code", "writing a novel", "looking for a job", "trying to save money", "learning French",
             "training for a race", "decluttering my home", "studying for exams", "building a habit of reading",
             "starting a business")]
    return out


def main() -> None:
    for p in dict.fromkeys(prompts()):
        print(json.dumps({"messages": [{"role": "user", "content": p}]}))


if __name__ == "__main__":
    main()
