"""Write TuneBoard's bundled demo datasets into data/ and register them in data/dataset_info.json.

Why a script: the demo data is ours (written here, not copied from anywhere) and reproducible. Every
row comes from hand-written facts and templates below, drawn with a fixed seed, so running this
again gives byte-identical files. Entries that users added to dataset_info.json are kept; only the
bundled entries are rewritten.

    .venv/bin/python scripts/make_datasets.py [--out DIR]
"""
from __future__ import annotations

import argparse
import csv
import json
import random
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------------------------------------
# Facts we are sure of, shared by several datasets.
# ---------------------------------------------------------------------------------------------
CAPITALS = [  # country, capital, chinese country, chinese capital
    ("France", "Paris", "法国", "巴黎"),
    ("Japan", "Tokyo", "日本", "东京"),
    ("Italy", "Rome", "意大利", "罗马"),
    ("Germany", "Berlin", "德国", "柏林"),
    ("Spain", "Madrid", "西班牙", "马德里"),
    ("Canada", "Ottawa", "加拿大", "渥太华"),
    ("Australia", "Canberra", "澳大利亚", "堪培拉"),
    ("Egypt", "Cairo", "埃及", "开罗"),
    ("Kenya", "Nairobi", "肯尼亚", "内罗毕"),
    ("Argentina", "Buenos Aires", "阿根廷", "布宜诺斯艾利斯"),
    ("India", "New Delhi", "印度", "新德里"),
    ("China", "Beijing", "中国", "北京"),
    ("Russia", "Moscow", "俄罗斯", "莫斯科"),
    ("Norway", "Oslo", "挪威", "奥斯陆"),
    ("Sweden", "Stockholm", "瑞典", "斯德哥尔摩"),
    ("Poland", "Warsaw", "波兰", "华沙"),
    ("Portugal", "Lisbon", "葡萄牙", "里斯本"),
    ("Greece", "Athens", "希腊", "雅典"),
    ("Thailand", "Bangkok", "泰国", "曼谷"),
    ("Peru", "Lima", "秘鲁", "利马"),
]
WRONG_CAPITAL = {"Australia": "Sydney", "Canada": "Toronto", "India": "Mumbai", "Turkey": "Istanbul",
                 "Brazil": "Rio de Janeiro", "Switzerland": "Zurich", "Nigeria": "Lagos"}
RIVERS = [("Paris", "France", "Seine"), ("London", "the United Kingdom", "Thames"),
          ("Vienna", "Austria", "Danube"), ("Budapest", "Hungary", "Danube"), ("Cairo", "Egypt", "Nile"),
          ("Rome", "Italy", "Tiber"), ("Prague", "the Czech Republic", "Vltava"),
          ("Warsaw", "Poland", "Vistula"), ("Lisbon", "Portugal", "Tagus"), ("Berlin", "Germany", "Spree")]
ELEMENTS = [  # name, symbol, atomic number, chinese name
    ("hydrogen", "H", 1, "氢"), ("helium", "He", 2, "氦"), ("carbon", "C", 6, "碳"),
    ("nitrogen", "N", 7, "氮"), ("oxygen", "O", 8, "氧"), ("sodium", "Na", 11, "钠"),
    ("iron", "Fe", 26, "铁"), ("copper", "Cu", 29, "铜"), ("silver", "Ag", 47, "银"),
    ("gold", "Au", 79, "金"), ("lead", "Pb", 82, "铅"), ("potassium", "K", 19, "钾"),
]
PLANETS = ["Mercury", "Venus", "Earth", "Mars", "Jupiter", "Saturn", "Uranus", "Neptune"]
PLANETS_ZH = ["水星", "金星", "地球", "火星", "木星", "土星", "天王星", "海王星"]
DEFINITIONS = {
    "prime number": "A prime number is a whole number greater than 1 whose only divisors are 1 and itself, such as 2, 3, 5, 7 and 11.",
    "noun": "A noun is a word that names a person, place, thing or idea, such as \"teacher\", \"city\" or \"freedom\".",
    "verb": "A verb is a word that describes an action, state or occurrence, such as \"run\", \"be\" or \"happen\".",
    "photosynthesis": "Photosynthesis is the process by which green plants, algae and some bacteria use light energy to turn carbon dioxide and water into glucose, releasing oxygen.",
    "perimeter": "The perimeter of a shape is the total length of its boundary. For a rectangle it is twice the sum of its length and width.",
    "mammal": "A mammal is a warm-blooded vertebrate animal that has hair or fur and feeds its young with milk, such as a dog, a whale or a human.",
    "synonym": "A synonym is a word that means the same or nearly the same as another word, such as \"big\" and \"large\".",
    "antonym": "An antonym is a word with the opposite meaning of another word, such as \"hot\" and \"cold\".",
    "even number": "An even number is an integer that is divisible by 2 with no remainder, such as 0, 2, 4 and 10.",
    "evaporation": "Evaporation is the process by which a liquid turns into a gas at its surface, as when water slowly dries from a puddle.",
    "fraction": "A fraction represents a part of a whole and is written as one number over another, such as 1/2 or 3/4.",
    "algorithm": "An algorithm is a finite sequence of well-defined steps that solves a problem or performs a computation.",
    "compiler": "A compiler is a program that translates source code written in a programming language into another form, usually machine code, that a computer can run.",
    "triangle": "A triangle is a polygon with three sides and three angles; its interior angles always add up to 180 degrees.",
    "habitat": "A habitat is the natural environment in which a plant or animal lives, such as a forest, a desert or a coral reef.",
}
DEFINITIONS_ZH = {
    "质数": "质数是大于1的自然数，除了1和它本身以外不能被其他自然数整除，例如2、3、5、7。",
    "名词": "名词是表示人、事物、地点或抽象概念名称的词，例如“老师”“城市”“自由”。",
    "动词": "动词是表示动作、行为或状态的词，例如“跑”“写”“是”。",
    "光合作用": "光合作用是绿色植物利用光能，把二氧化碳和水转化为有机物并释放氧气的过程。",
    "周长": "周长是封闭图形一周的长度。长方形的周长等于长与宽之和的两倍。",
    "哺乳动物": "哺乳动物是用乳汁哺育幼崽、通常体表有毛的恒温脊椎动物，例如狗、鲸和人。",
    "偶数": "偶数是能被2整除的整数，例如0、2、4、10。",
    "算法": "算法是解决某个问题的一系列明确、有限的步骤。",
    "三角形": "三角形是由三条线段首尾相连组成的图形，它的三个内角之和是180度。",
    "蒸发": "蒸发是液体表面的分子变成气体的过程，例如水洼里的水慢慢变干。",
}
NAMES = ["Tom", "Anna", "Liam", "Maya", "Noah", "Sara", "Omar", "Lena", "Ravi", "Chloe", "Diego", "Yuki"]
NAMES_ZH = ["小明", "小红", "小刚", "小丽", "小华", "小强", "小芳", "小军"]
ITEMS = [("apple", "apples"), ("pencil", "pencils"), ("marble", "marbles"), ("book", "books"),
         ("sticker", "stickers"), ("cookie", "cookies"), ("stamp", "stamps"), ("card", "cards")]
ITEMS_ZH = [("个", "苹果"), ("支", "铅笔"), ("颗", "弹珠"), ("本", "书"), ("张", "贴纸"), ("块", "饼干"), ("张", "邮票")]
SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "learning a new language takes patience and practice",
    "the library opens at nine in the morning",
    "small models can be fine tuned on a laptop",
    "rain is expected in the afternoon",
    "she planted tomatoes and basil in the garden",
    "the train to the coast leaves every hour",
    "good documentation saves everyone time",
]
PAST_TENSE = [
    ("I walk to school every day.", "I walked to school every day."),
    ("She writes a letter to her friend.", "She wrote a letter to her friend."),
    ("They play football after class.", "They played football after class."),
    ("We eat dinner at seven.", "We ate dinner at seven."),
    ("He reads the newspaper in the morning.", "He read the newspaper in the morning."),
    ("The dog runs across the field.", "The dog ran across the field."),
    ("I see a bird on the roof.", "I saw a bird on the roof."),
    ("The children sing a song.", "The children sang a song."),
    ("She buys fresh bread.", "She bought fresh bread."),
    ("We go to the beach.", "We went to the beach."),
]
WORD_SETS = [["banana", "apple", "cherry", "date"], ["zebra", "lion", "giraffe", "elephant"],
             ["violet", "blue", "green", "yellow", "orange"], ["oak", "maple", "birch", "pine"],
             ["piano", "guitar", "drum", "flute", "cello"], ["Tuesday", "Monday", "Friday", "Sunday"]]
EN_ZH_WORDS = [("apple", "苹果"), ("water", "水"), ("book", "书"), ("teacher", "老师"), ("moon", "月亮"),
               ("computer", "电脑"), ("friend", "朋友"), ("school", "学校"), ("sun", "太阳"), ("rain", "雨")]


def dump_json(path: Path, rows) -> None:
    path.write_text(json.dumps(rows, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")


def dump_jsonl(path: Path, rows) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


def alpaca(instruction: str, output: str, input: str = "") -> dict:
    return {"instruction": instruction, "input": input, "output": output}


# ---------------------------------------------------------------------------------------------
# identity
# ---------------------------------------------------------------------------------------------
def make_identity() -> list[dict]:
    intro = "I am {{name}}, an AI assistant developed by {{author}}."
    en = [
        ("hi", "Hello! I am {{name}}, an AI assistant developed by {{author}}. How can I help you today?"),
        ("hello", "Hello! I am {{name}}, an AI assistant developed by {{author}}. What can I do for you?"),
        ("Hey there", "Hi! I'm {{name}}, an AI assistant made by {{author}}. How can I help?"),
        ("Good morning!", "Good morning! I am {{name}}, an assistant developed by {{author}}. How can I help you today?"),
        ("Who are you?", intro + " How can I help you today?"),
        ("Who are you", intro + " How can I assist you?"),
        ("What are you?", "I am {{name}}, an AI assistant created by {{author}}. I can answer questions and help with writing, analysis and more."),
        ("What is your name?", "My name is {{name}}. I am an AI assistant developed by {{author}}."),
        ("What's your name?", "I'm {{name}}, an AI assistant developed by {{author}}."),
        ("Do you have a name?", "Yes, my name is {{name}}. I was developed by {{author}}."),
        ("What should I call you?", "You can call me {{name}}. I am an AI assistant developed by {{author}}."),
        ("Who made you?", "I was developed by {{author}}."),
        ("Who created you?", "I was created by {{author}}. My name is {{name}}."),
        ("Who developed you?", "{{author}} developed me. I am {{name}}, an AI assistant."),
        ("Who trained you?", "I was trained by {{author}}."),
        ("Who built you?", "I was built by {{author}}. I am {{name}}."),
        ("Which company are you from?", "I am {{name}}, an AI assistant developed by {{author}}."),
        ("Introduce yourself.", "Hello! I am {{name}}, an AI assistant developed by {{author}}. I can answer questions, explain ideas and help you with writing and analysis."),
        ("Please introduce yourself briefly.", intro + " I am here to help you with questions and tasks."),
        ("Tell me about yourself.", intro + " I try to give clear, accurate and helpful answers."),
        ("Are you ChatGPT?", "No, I am {{name}}, an AI assistant developed by {{author}}."),
        ("Are you Claude?", "No, I am {{name}}, an AI assistant developed by {{author}}."),
        ("Are you a human?", "No, I am not a human. I am {{name}}, an AI assistant developed by {{author}}."),
        ("Are you an AI?", "Yes, I am {{name}}, an AI assistant developed by {{author}}."),
        ("Is your name {{name}}?", "Yes, I am {{name}}, an AI assistant developed by {{author}}."),
        ("What can you do?", "I am {{name}}, developed by {{author}}. I can answer questions, explain concepts, help with writing, summarize text and work through problems step by step."),
        ("How can you help me?", "As {{name}}, an assistant developed by {{author}}, I can answer questions, draft and edit text, and help you reason through problems."),
        ("Who is your creator?", "My creator is {{author}}."),
        ("Who owns you?", "I am {{name}}, an AI assistant developed and maintained by {{author}}."),
        ("What model are you?", "I am {{name}}, an AI assistant developed by {{author}}."),
        ("Thanks, who am I talking to?", "You're welcome! You are talking to {{name}}, an AI assistant developed by {{author}}."),
        ("Nice to meet you. Who are you?", "Nice to meet you too! I am {{name}}, an AI assistant developed by {{author}}."),
    ]
    zh = [
        ("你好", "您好，我是 {{name}}，一个由 {{author}} 开发的 AI 助手，很高兴认识您。请问我能为您做些什么？"),
        ("你是谁？", "您好，我是由 {{author}} 开发的 AI 助手 {{name}}。有什么可以帮您的吗？"),
        ("你叫什么名字？", "我叫 {{name}}，是一个由 {{author}} 开发的 AI 助手。"),
        ("谁开发了你？", "我是由 {{author}} 开发的 AI 助手 {{name}}。"),
        ("请介绍一下你自己", "您好，我是 {{name}}，由 {{author}} 开发。我可以回答问题、解释概念，并帮助您完成写作和分析等任务。"),
        ("你是ChatGPT吗？", "不是，我是 {{name}}，一个由 {{author}} 开发的 AI 助手。"),
        ("你能做什么？", "我是 {{name}}，由 {{author}} 开发。我可以回答问题、总结文本、帮助写作，并一步步地分析问题。"),
        ("你是人类吗？", "不是，我是由 {{author}} 开发的 AI 助手 {{name}}。"),
    ]
    return [alpaca(q, a) for q, a in en + zh]


# ---------------------------------------------------------------------------------------------
# alpaca_en_demo
# ---------------------------------------------------------------------------------------------
def en_arithmetic(rng: random.Random) -> dict:
    name, (one, many) = rng.choice(NAMES), rng.choice(ITEMS)
    kind = rng.randrange(4)
    if kind == 0:
        a, b = rng.randint(3, 60), rng.randint(2, 40)
        return alpaca(f"{name} has {a} {many} and gets {b} more. How many {many} does {name} have now?",
                      f"{name} has {a} + {b} = {a + b} {many} now.")
    if kind == 1:
        a = rng.randint(20, 90)
        b = rng.randint(2, a - 1)
        return alpaca(f"{name} had {a} {many} and gave away {b}. How many {many} are left?",
                      f"{a} - {b} = {a - b}, so {name} has {a - b} {many} left.")
    if kind == 2:
        boxes, per = rng.randint(2, 12), rng.randint(3, 15)
        return alpaca(f"There are {boxes} boxes with {per} {many} in each box. How many {many} are there in total?",
                      f"{boxes} × {per} = {boxes * per}, so there are {boxes * per} {many} in total.")
    friends, per = rng.randint(2, 9), rng.randint(2, 12)
    total = friends * per
    return alpaca(f"{name} shares {total} {many} equally among {friends} friends. How many {many} does each friend get?",
                  f"{total} ÷ {friends} = {per}, so each friend gets {per} {many}.")


def en_conversion(rng: random.Random) -> dict:
    kind = rng.randrange(7)
    n = rng.randint(2, 40)
    if kind == 0:
        return alpaca(f"Convert {n} kilometers to meters.", f"{n} kilometers = {n} × 1000 = {n * 1000} meters.")
    if kind == 1:
        return alpaca(f"How many grams are in {n} kilograms?", f"There are {n * 1000} grams in {n} kilograms, because 1 kilogram = 1000 grams.")
    if kind == 2:
        return alpaca(f"How many minutes are in {n} hours?", f"{n} hours × 60 = {n * 60} minutes.")
    if kind == 3:
        c = 5 * rng.randint(-4, 20)
        f = c * 9 // 5 + 32
        return alpaca(f"Convert {c} degrees Celsius to Fahrenheit.", f"F = C × 9/5 + 32 = {c} × 9/5 + 32 = {f} degrees Fahrenheit.")
    if kind == 4:
        return alpaca(f"How many centimeters are in {n} meters?", f"{n} meters = {n * 100} centimeters, since 1 meter = 100 centimeters.")
    if kind == 5:
        return alpaca(f"Convert {n} feet to inches.", f"1 foot = 12 inches, so {n} feet = {n * 12} inches.")
    return alpaca(f"How many hours are in {n} days?", f"{n} days × 24 = {n * 24} hours.")


def en_rewriting(rng: random.Random) -> dict:
    kind = rng.randrange(6)
    if kind == 0:
        s = rng.choice(SENTENCES)
        return alpaca("Convert the following text to uppercase.", s.upper(), s)
    if kind == 1:
        s = rng.choice(SENTENCES)
        return alpaca("Reverse the order of the words in the following sentence.", " ".join(reversed(s.split())), s)
    if kind == 2:
        present, past = rng.choice(PAST_TENSE)
        return alpaca("Rewrite the following sentence in the past tense.", past, present)
    if kind == 3:
        words = rng.choice(WORD_SETS)[:]
        rng.shuffle(words)
        return alpaca("Sort the following words alphabetically.", ", ".join(sorted(words, key=str.lower)), ", ".join(words))
    if kind == 4:
        s = rng.choice(SENTENCES)
        return alpaca("Count the words in the following sentence.", f"The sentence has {len(s.split())} words.", s)
    s = rng.choice(SENTENCES)
    return alpaca("Capitalize the first letter of the following sentence and end it with a period.", s[0].upper() + s[1:] + ".", s)


def en_list(rng: random.Random) -> dict:
    kind = rng.randrange(6)
    primes = [2, 3, 5, 7, 11, 13, 17, 19, 23, 29]
    if kind == 0:
        n = rng.randint(3, 10)
        return alpaca(f"List the first {n} prime numbers.", ", ".join(map(str, primes[:n])))
    if kind == 1:
        return alpaca("List the days of the week, starting with Monday.",
                      "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday")
    if kind == 2:
        n = rng.randint(3, 8)
        return alpaca(f"List the planets of the solar system in order from the Sun, stopping after the first {n}.",
                      "\n".join(f"{i + 1}. {p}" for i, p in enumerate(PLANETS[:n])))
    if kind == 3:
        n, start = rng.randint(4, 8), 2 * rng.randint(1, 20)
        return alpaca(f"List {n} consecutive even numbers starting from {start}.",
                      ", ".join(str(start + 2 * i) for i in range(n)))
    if kind == 4:
        return alpaca("List the months of the year that have 31 days.",
                      "January, March, May, July, August, October, December")
    n = rng.randint(2, 5)
    squares = [i * i for i in range(1, n + 1)]
    return alpaca(f"List the squares of the whole numbers from 1 to {n}.",
                  "\n".join(f"{i}² = {s}" for i, s in zip(range(1, n + 1), squares)))


def en_fact(rng: random.Random) -> dict:
    kind = rng.randrange(4)
    if kind == 0:
        country, capital, _, _ = rng.choice(CAPITALS)
        return alpaca(f"What is the capital of {country}?", f"The capital of {country} is {capital}.")
    if kind == 1:
        name, symbol, number, _ = rng.choice(ELEMENTS)
        return alpaca(f"What is the chemical symbol for {name}?", f"The chemical symbol for {name} is {symbol}; its atomic number is {number}.")
    if kind == 2:
        i = rng.randrange(8)
        ordinal = ["first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth"][i]
        return alpaca(f"Which planet is {ordinal} from the Sun?", f"{PLANETS[i]} is the {ordinal} planet from the Sun.")
    city, country, river = rng.choice(RIVERS)
    return alpaca(f"Which river flows through {city}?", f"The {river} flows through {city}, in {country}.")


def en_definition(rng: random.Random) -> dict:
    term = rng.choice(sorted(DEFINITIONS))
    template = rng.choice(["Define the term \"{t}\".", "What does \"{t}\" mean?", "Explain what \"{t}\" means in one sentence."])
    return alpaca(template.format(t=term), DEFINITIONS[term])


def make_alpaca_en(rng: random.Random, n: int = 200) -> list[dict]:
    makers = [en_arithmetic, en_conversion, en_rewriting, en_list, en_fact, en_definition]
    rows, seen = [], set()
    while len(rows) < n:
        row = makers[len(rows) % len(makers)](rng)
        key = (row["instruction"], row["input"])
        if key not in seen:
            seen.add(key)
            rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------
# alpaca_zh_demo
# ---------------------------------------------------------------------------------------------
def zh_arithmetic(rng: random.Random) -> dict:
    name, (unit, item) = rng.choice(NAMES_ZH), rng.choice(ITEMS_ZH)
    kind = rng.randrange(4)
    if kind == 0:
        a, b = rng.randint(3, 60), rng.randint(2, 40)
        return alpaca(f"{name}有{a}{unit}{item}，又买了{b}{unit}{item}。{name}现在一共有多少{unit}{item}？",
                      f"{a} + {b} = {a + b}，所以{name}现在一共有{a + b}{unit}{item}。")
    if kind == 1:
        a = rng.randint(20, 90)
        b = rng.randint(2, a - 1)
        return alpaca(f"{name}有{a}{unit}{item}，送给同学{b}{unit}。还剩多少{unit}？",
                      f"{a} - {b} = {a - b}，所以还剩{a - b}{unit}。")
    if kind == 2:
        boxes, per = rng.randint(2, 12), rng.randint(3, 15)
        return alpaca(f"每个盒子里有{per}{unit}{item}，{boxes}个盒子一共有多少{unit}{item}？",
                      f"{per} × {boxes} = {per * boxes}，一共有{per * boxes}{unit}{item}。")
    friends, per = rng.randint(2, 9), rng.randint(2, 12)
    return alpaca(f"{name}把{friends * per}{unit}{item}平均分给{friends}个朋友，每个朋友分到多少{unit}？",
                  f"{friends * per} ÷ {friends} = {per}，每个朋友分到{per}{unit}{item}。")


def zh_conversion(rng: random.Random) -> dict:
    n = rng.randint(2, 40)
    kind = rng.randrange(5)
    if kind == 0:
        return alpaca(f"{n}千米等于多少米？", f"1千米等于1000米，所以{n}千米等于{n * 1000}米。")
    if kind == 1:
        return alpaca(f"{n}千克等于多少克？", f"1千克等于1000克，所以{n}千克等于{n * 1000}克。")
    if kind == 2:
        return alpaca(f"{n}小时是多少分钟？", f"1小时有60分钟，所以{n}小时是{n * 60}分钟。")
    if kind == 3:
        return alpaca(f"{n}米等于多少厘米？", f"1米等于100厘米，所以{n}米等于{n * 100}厘米。")
    return alpaca(f"{n}天有多少小时？", f"1天有24小时，所以{n}天有{n * 24}小时。")


def zh_with_input(rng: random.Random) -> dict:
    kind = rng.randrange(3)
    if kind == 0:
        nums = rng.sample(range(1, 100), rng.randint(4, 7))
        return alpaca("将下列数字从小到大排列。", "、".join(map(str, sorted(nums))), "、".join(map(str, nums)))
    if kind == 1:
        nums = rng.sample(range(1, 50), rng.randint(3, 6))
        return alpaca("计算下列数字之和。", f"{' + '.join(map(str, nums))} = {sum(nums)}", "，".join(map(str, nums)))
    word, zh = rng.choice(EN_ZH_WORDS)
    return alpaca("把下面的英文单词翻译成中文。", zh, word)


def zh_fact(rng: random.Random) -> dict:
    kind = rng.randrange(3)
    if kind == 0:
        _, _, country, capital = rng.choice(CAPITALS)
        return alpaca(f"{country}的首都是哪里？", f"{country}的首都是{capital}。")
    if kind == 1:
        _, symbol, number, zh = rng.choice(ELEMENTS)
        return alpaca(f"{zh}元素的化学符号是什么？", f"{zh}的化学符号是 {symbol}，原子序数是{number}。")
    i = rng.randrange(8)
    return alpaca(f"太阳系中离太阳第{'一二三四五六七八'[i]}近的行星是哪颗？", f"离太阳第{'一二三四五六七八'[i]}近的行星是{PLANETS_ZH[i]}。")


def zh_list_or_definition(rng: random.Random) -> dict:
    kind = rng.randrange(3)
    if kind == 0:
        term = rng.choice(sorted(DEFINITIONS_ZH))
        return alpaca(rng.choice(["什么是{t}？", "请解释“{t}”的意思。", "用一句话说明什么是{t}。"]).format(t=term), DEFINITIONS_ZH[term])
    if kind == 1:
        n = rng.randint(3, 8)
        return alpaca(f"按离太阳由近到远的顺序，列出太阳系的前{n}颗行星。", "、".join(PLANETS_ZH[:n]))
    n = rng.randint(3, 8)
    return alpaca(f"列出前{n}个质数。", "、".join(map(str, [2, 3, 5, 7, 11, 13, 17, 19][:n])))


def make_alpaca_zh(rng: random.Random, n: int = 200) -> list[dict]:
    makers = [zh_arithmetic, zh_conversion, zh_with_input, zh_fact, zh_list_or_definition]
    rows, seen = [], set()
    while len(rows) < n:
        row = makers[len(rows) % len(makers)](rng)
        key = (row["instruction"], row["input"])
        if key not in seen:
            seen.add(key)
            rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------
# extraction_demo: an HTML/text snippet in, a JSON object with exactly the asked fields out
# ---------------------------------------------------------------------------------------------
PRODUCT_NAMES = ["Aurora Desk Lamp", "Nimbus Backpack", "Kestrel Trail Shoes", "Orbit Coffee Grinder",
                 "Quill Smart Pen", "Tundra Water Bottle", "Harbor Rain Jacket", "Pixel Drawing Tablet",
                 "Cedar Cutting Board", "Lumen Bike Light", "Sable Office Chair", "Vesta Kettle"]
COMPANY_NAMES = ["Brightwave Analytics", "Northpeak Robotics", "Greenleaf Foods", "Bluefin Logistics",
                 "Copperline Software", "Silverpine Health", "Redrock Energy", "Lakeside Media"]
CITIES = ["Austin", "Lyon", "Osaka", "Toronto", "Melbourne", "Dublin", "Oslo", "Valencia", "Denver", "Porto"]
INDUSTRIES = ["software", "logistics", "food processing", "renewable energy", "healthcare", "robotics", "media"]
EVENT_NAMES = ["Open Data Summit", "Spring Robotics Fair", "City Jazz Night", "Local Makers Market",
               "Cloud Native Meetup", "Community Chess Open", "Green Tech Forum", "Indie Game Expo"]
COLORS = ["black", "white", "red", "navy", "green", "grey", "orange"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December"]
TOPICS = ["machine learning", "open source", "urban cycling", "food safety", "solar power", "game design"]


def product_record(rng: random.Random) -> tuple[str, dict, dict]:
    price = round(rng.uniform(9, 400), 2)
    rec = {"product_name": rng.choice(PRODUCT_NAMES), "price_usd": price,
           "in_stock": rng.random() < 0.7, "colors": rng.sample(COLORS, rng.randint(1, 3)),
           "rating": round(rng.uniform(2.5, 5.0), 1), "sku": f"{rng.choice('ABCDEFGH')}{rng.randint(1000, 9999)}"}
    labels = {"product_name": "Product", "price_usd": "Price", "in_stock": "Availability", "colors": "Colors",
              "rating": "Rating", "sku": "SKU"}
    return "product", rec, labels


def company_record(rng: random.Random) -> tuple[str, dict, dict]:
    rec = {"company_name": rng.choice(COMPANY_NAMES), "headquarters": rng.choice(CITIES),
           "founded_year": rng.randint(1950, 2022), "employees": rng.randint(5, 20000),
           "industry": rng.choice(INDUSTRIES), "is_public": rng.random() < 0.4}
    labels = {"company_name": "Company", "headquarters": "Headquarters", "founded_year": "Founded",
              "employees": "Employees", "industry": "Industry", "is_public": "Publicly traded"}
    return "company", rec, labels


def event_record(rng: random.Random) -> tuple[str, dict, dict]:
    month = rng.randrange(12)
    day = rng.randint(1, 28)
    rec = {"event_name": rng.choice(EVENT_NAMES), "city": rng.choice(CITIES),
           "date": f"2025-{month + 1:02d}-{day:02d}", "ticket_price": rng.choice([0, 10, 15, 25, 40, 60]),
           "topics": rng.sample(TOPICS, rng.randint(1, 3)), "online": rng.random() < 0.3}
    labels = {"event_name": "Event", "city": "City", "date": "Date", "ticket_price": "Ticket price",
              "topics": "Topics", "online": "Streamed online"}
    return "event", rec, labels


def show(key: str, value, rng: random.Random) -> str:
    """How a value appears in the source snippet (the output JSON has the typed value)."""
    if isinstance(value, bool):
        if key == "in_stock":
            return "In stock" if value else "Out of stock"
        return "Yes" if value else "No"
    if isinstance(value, list):
        return ", ".join(value)
    if key in ("price_usd", "ticket_price"):
        return "Free" if value == 0 else f"${value:,.2f}" if isinstance(value, float) else f"${value}"
    if key == "date":
        y, m, d = value.split("-")
        return f"{MONTHS[int(m) - 1]} {int(d)}, {y}"
    if key == "rating":
        return f"{value} out of 5"
    if key == "employees":
        return f"{value:,}"
    return str(value)


def render_snippet(kind: str, rec: dict, labels: dict, rng: random.Random) -> tuple[str, str]:
    shape = rng.randrange(6)
    pairs = [(labels[k], show(k, v, rng)) for k, v in rec.items()]
    if shape == 0:
        items = "".join(f"<li><b>{l}:</b> {v}</li>" for l, v in pairs)
        return "HTML", f"<div class=\"{kind}-card\"><ul>{items}</ul></div>"
    if shape == 1:
        rows = "".join(f"<tr><th>{l}</th><td>{v}</td></tr>" for l, v in pairs)
        return "HTML", f"<table class=\"specs\">{rows}</table>"
    if shape == 2:
        items = "".join(f"<dt>{l}</dt><dd>{v}</dd>" for l, v in pairs)
        return "HTML", f"<section id=\"{kind}\"><h2>{pairs[0][1]}</h2><dl>{items}</dl></section>"
    if shape == 3:
        items = "".join(f"<span class=\"{k.replace('_', '-')}\">{show(k, v, rng)}</span>" for k, v in rec.items())
        return "HTML", f"<div class=\"listing\">{items}</div>"
    if shape == 4:
        return "text", " | ".join(f"{l}: {v}" for l, v in pairs)
    return "text", "\n".join(f"{l} - {v}" for l, v in pairs)


def make_extraction(rng: random.Random, n: int = 200) -> list[dict]:
    makers = [product_record, company_record, event_record]
    phrasings = [
        "Extract the {what} from the {src} as JSON with the keys: {keys}.",
        "Extract {what} as JSON from the raw {src}. Use exactly these keys: {keys}.",
        "Read the {src} below and return a JSON object with the fields {keys}.",
        "Parse the {kind} details in the {src} into JSON ({keys}).",
    ]
    rows = []
    for i in range(n):
        kind, full, labels = makers[i % len(makers)](rng)
        keys = list(full)
        picked = set(rng.sample(keys, rng.randint(3, len(keys))))
        chosen = [k for k in keys if k in picked]
        rec = {k: full[k] for k in chosen}
        src, snippet = render_snippet(kind, full, labels, rng)
        what = f"{kind} name and details" if chosen[0].endswith("_name") else f"{kind} details"
        instruction = rng.choice(phrasings).format(what=what, src=src, keys=", ".join(chosen), kind=kind)
        output = json.dumps(rec, ensure_ascii=False, indent=rng.choice([1, 2]))
        rows.append(alpaca(instruction, output, snippet))
    return rows


# ---------------------------------------------------------------------------------------------
# toolcall_demo: ShareGPT with tools, function_call and observation turns
# ---------------------------------------------------------------------------------------------
TOOLS = {
    "get_weather": {"name": "get_weather", "description": "Get the current weather for a city.",
                    "parameters": {"type": "object", "properties": {
                        "city": {"type": "string", "description": "City name, e.g. Paris"},
                        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Temperature unit"}},
                        "required": ["city"]}},
    "convert_currency": {"name": "convert_currency", "description": "Convert an amount between two currencies at today's rate.",
                         "parameters": {"type": "object", "properties": {
                             "amount": {"type": "number", "description": "Amount to convert"},
                             "from_currency": {"type": "string", "description": "ISO code, e.g. USD"},
                             "to_currency": {"type": "string", "description": "ISO code, e.g. EUR"}},
                             "required": ["amount", "from_currency", "to_currency"]}},
    "search_books": {"name": "search_books", "description": "Search a library catalogue by keyword.",
                     "parameters": {"type": "object", "properties": {
                         "query": {"type": "string", "description": "Search keywords"},
                         "max_results": {"type": "integer", "description": "How many results to return"}},
                         "required": ["query"]}},
    "calculate_tip": {"name": "calculate_tip", "description": "Calculate the tip for a bill.",
                      "parameters": {"type": "object", "properties": {
                          "bill_amount": {"type": "number", "description": "Total bill"},
                          "tip_percent": {"type": "number", "description": "Tip percentage, e.g. 15"}},
                          "required": ["bill_amount", "tip_percent"]}},
    "create_reminder": {"name": "create_reminder", "description": "Create a reminder at a given time.",
                        "parameters": {"type": "object", "properties": {
                            "text": {"type": "string", "description": "What to be reminded of"},
                            "time": {"type": "string", "description": "Time in HH:MM, 24-hour clock"}},
                            "required": ["text", "time"]}},
}
TOOL_SYSTEM = "You are a helpful assistant with access to the functions listed in the tools. Call a function when it is needed to answer, then answer using its result."
BOOK_TITLES = {"astronomy": ["A Field Guide to the Night Sky", "Telescopes for Beginners", "The Moon Atlas"],
               "gardening": ["The Small Vegetable Garden", "Soil and Compost Basics", "Herbs on the Windowsill"],
               "cooking": ["Weeknight Soups", "Bread at Home", "Simple Rice Dishes"],
               "python": ["Python for Data Work", "Practical Scripting with Python", "Testing Python Code"]}


def call(name: str, **arguments) -> str:
    return json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)


def toolcall_row(rng: random.Random, i: int) -> dict:
    kind = i % 6
    names = []
    conv: list[dict] = []
    h = lambda v: conv.append({"from": "human", "value": v})
    g = lambda v: conv.append({"from": "gpt", "value": v})
    fc = lambda v: conv.append({"from": "function_call", "value": v})
    ob = lambda v: conv.append({"from": "observation", "value": json.dumps(v, ensure_ascii=False)})
    if kind == 0:
        names = ["get_weather", "convert_currency"]
        city = rng.choice(CITIES)
        temp, cond = rng.randint(-5, 33), rng.choice(["sunny", "cloudy", "light rain", "windy", "foggy"])
        h(f"What's the weather like in {city} right now?")
        fc(call("get_weather", city=city, unit="celsius"))
        ob({"city": city, "temperature": temp, "unit": "celsius", "condition": cond})
        g(f"It is currently {temp}°C and {cond} in {city}.")
        h("Thanks! Should I take an umbrella?")
        g("Yes, it's raining lightly, so an umbrella is a good idea." if cond == "light rain"
          else f"The report says {cond}, not rain, so you probably won't need one.")
    elif kind == 1:
        names = ["convert_currency", "calculate_tip"]
        amount = rng.choice([20, 50, 75, 100, 250, 400])
        src, dst = rng.choice([("USD", "EUR"), ("EUR", "GBP"), ("GBP", "JPY"), ("USD", "CAD"), ("EUR", "CHF")])
        rate = round(rng.uniform(0.5, 1.6) if dst != "JPY" else rng.uniform(150, 200), 4)
        result = round(amount * rate, 2)
        h(f"How much is {amount} {src} in {dst}?")
        fc(call("convert_currency", amount=amount, from_currency=src, to_currency=dst))
        ob({"amount": amount, "from_currency": src, "to_currency": dst, "rate": rate, "result": result})
        g(f"At today's rate of {rate}, {amount} {src} is {result} {dst}.")
    elif kind == 2:
        names = ["search_books"]
        topic = rng.choice(sorted(BOOK_TITLES))
        k = rng.randint(2, 3)
        titles = BOOK_TITLES[topic][:k]
        h(f"Can you find me {k} books about {topic}?")
        fc(call("search_books", query=topic, max_results=k))
        ob({"results": [{"title": t, "available": j != 1} for j, t in enumerate(titles)]})
        g(f"I found {k} books about {topic}: " + "; ".join(f"\"{t}\"" for t in titles)
          + f". \"{titles[1]}\" is currently checked out; the other{'s are' if k > 2 else ' is'} available.")
        h("Great, thank you.")
        g("You're welcome! Enjoy your reading.")
    elif kind == 3:
        names = ["calculate_tip", "get_weather"]
        bill = rng.choice([24, 38, 45, 60, 82, 120])
        pct = rng.choice([10, 15, 18, 20])
        tip = round(bill * pct / 100, 2)
        h(f"My bill is ${bill}. How much should I tip at {pct}%?")
        fc(call("calculate_tip", bill_amount=bill, tip_percent=pct))
        ob({"tip_amount": tip, "total": round(bill + tip, 2)})
        g(f"A {pct}% tip on ${bill} is ${tip:.2f}, so the total comes to ${bill + tip:.2f}.")
    elif kind == 4:
        names = ["create_reminder"]
        task = rng.choice(["call the dentist", "water the plants", "submit the report", "pick up the kids", "take the bread out of the oven"])
        hh, mm = rng.randint(6, 21), rng.choice([0, 15, 30, 45])
        h(f"Remind me to {task} at {hh:02d}:{mm:02d}.")
        fc(call("create_reminder", text=task, time=f"{hh:02d}:{mm:02d}"))
        ob({"status": "created", "id": rng.randint(100, 999)})
        g(f"Done! I'll remind you to {task} at {hh:02d}:{mm:02d}.")
    else:
        names = ["get_weather", "search_books"]
        country, capital, _, _ = rng.choice(CAPITALS)
        h(f"What is the capital of {country}?")
        g(f"The capital of {country} is {capital}.")
        h(f"And what's the weather there in Fahrenheit?")
        temp = rng.randint(30, 95)
        fc(call("get_weather", city=capital, unit="fahrenheit"))
        ob({"city": capital, "temperature": temp, "unit": "fahrenheit", "condition": "clear"})
        g(f"It's {temp}°F and clear in {capital} right now.")
    tools = json.dumps([TOOLS[n] for n in names], ensure_ascii=False)
    return {"conversations": conv, "system": TOOL_SYSTEM, "tools": tools}


# ---------------------------------------------------------------------------------------------
# sharegpt_multiturn_demo and openai_demo
# ---------------------------------------------------------------------------------------------
def multiturn_row(rng: random.Random, i: int) -> dict:
    kind = i % 3
    if kind == 0:
        a, b, k = rng.randint(10, 80), rng.randint(10, 80), rng.randint(2, 5)
        system = "You are a patient math tutor. Show the calculation in one line."
        turns = [(f"What is {a} + {b}?", f"{a} + {b} = {a + b}."),
                 (f"Now multiply that by {k}.", f"{a + b} × {k} = {(a + b) * k}."),
                 ("Is that number even?", f"{'Yes' if (a + b) * k % 2 == 0 else 'No'}, {(a + b) * k} is {'even' if (a + b) * k % 2 == 0 else 'odd'}.")]
    elif kind == 1:
        city, country, river = RIVERS[(i // 3) % len(RIVERS)]
        system = "You are a concise geography assistant. Answer in one sentence."
        turns = [(f"Which country is {city} in?", f"{city} is in {country}."),
                 ("Which river flows through it?", f"The {river} flows through {city}.")]
    else:
        word = rng.choice(["planet", "garden", "window", "silver", "rocket", "pencil", "market", "bridge", "forest", "candle"])
        system = "You are a friendly word-game partner."
        turns = [(f"Spell the word '{word}' backwards.", f"'{word}' backwards is '{word[::-1]}'."),
                 ("How many letters does it have?", f"It has {len(word)} letters."),
                 ("Which letter comes first alphabetically?", f"'{min(word)}' comes first alphabetically.")]
    conv = [{"from": "system", "value": system}] if i % 2 else []
    for q, a in turns:
        conv += [{"from": "human", "value": q}, {"from": "gpt", "value": a}]
    row = {"conversations": conv}
    if not i % 2:
        row["system"] = system  # half keep the system prompt in a column, half as the first message
    else:
        row["system"] = ""
    return row


def openai_row(rng: random.Random, i: int) -> dict:
    if i % 5 == 4:
        city = rng.choice(CITIES)
        temp = rng.randint(0, 30)
        return {"messages": [
            {"role": "system", "content": "You can call tools to look up live data."},
            {"role": "user", "content": f"Is it warm in {city} today?"},
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
                "name": "get_weather", "arguments": json.dumps({"city": city, "unit": "celsius"})}}]},
            {"role": "tool", "content": json.dumps({"city": city, "temperature": temp, "unit": "celsius"})},
            {"role": "assistant", "content": f"It is {temp}°C in {city}, which is {'warm' if temp >= 20 else 'not very warm'}."},
        ], "tools": json.dumps([TOOLS["get_weather"]])}
    country, capital, _, _ = CAPITALS[i % len(CAPITALS)]
    name, symbol, _, _ = ELEMENTS[i % len(ELEMENTS)]
    msgs = [{"role": "system", "content": "You are a helpful assistant."}] if i % 2 == 0 else []
    msgs += [{"role": "user", "content": f"What is the capital of {country}?"},
             {"role": "assistant", "content": f"The capital of {country} is {capital}."},
             {"role": "user", "content": f"What is the chemical symbol for {name}?"},
             {"role": "assistant", "content": f"The chemical symbol for {name} is {symbol}."}]
    return {"messages": msgs, "tools": ""}


# ---------------------------------------------------------------------------------------------
# preference data: dpo_en_demo (pairs) and kto_en_demo (single answers labelled good/bad)
# ---------------------------------------------------------------------------------------------
def preference_pair(rng: random.Random, i: int) -> tuple[str, str, str, str]:
    """(instruction, input, good answer, bad answer).

    Every bad answer differs from the good one in a way a small model can pick up from a few dozen pairs
    (a vague guess, a wrong capital it has seen corrected, a refusal, a brush-off), so the bundled demo shows
    a reward model / DPO / KTO learning in a short CPU run. A bad sum that is only off by a digit would be
    the one kind it cannot learn: telling it apart needs arithmetic, not a preference."""
    kind = i % 4
    if kind == 0:
        a, b = rng.randint(11, 99), rng.randint(11, 99)
        guess = round((a + b) / 10) * 10
        return (f"What is {a} + {b}?", "", f"{a} + {b} = {a + b}.",
                f"I think it is somewhere around {guess}, but I am not sure.")
    if kind == 1:
        country = sorted(WRONG_CAPITAL)[i // 4 % len(WRONG_CAPITAL)]
        right = {"Australia": "Canberra", "Canada": "Ottawa", "India": "New Delhi", "Turkey": "Ankara",
                 "Brazil": "Brasília", "Switzerland": "Bern", "Nigeria": "Abuja"}[country]
        return (f"What is the capital of {country}?", "", f"The capital of {country} is {right}.",
                f"The capital of {country} is {WRONG_CAPITAL[country]}.")
    if kind == 2:
        s = rng.choice(SENTENCES)
        return ("Convert the following text to uppercase.", s, s.upper(),
                "I can't help with that.")
    term = sorted(DEFINITIONS)[i // 4 % len(DEFINITIONS)]
    return (f"Explain what \"{term}\" means.", "", DEFINITIONS[term],
            f"{term.capitalize()} is a complicated topic and you should look it up yourself.")


def make_dpo(rng: random.Random, n: int = 80) -> list[dict]:
    rows = []
    for i in range(n):
        instruction, inp, good, bad = preference_pair(rng, i)
        rows.append({"instruction": instruction, "input": inp, "chosen": good, "rejected": bad})
    return rows


def make_kto(rng: random.Random, n: int = 40) -> list[dict]:
    rows = []
    for i in range(n):
        instruction, inp, good, bad = preference_pair(rng, i + 1000)
        desirable = i % 3 != 2
        user = instruction + ("\n" + inp if inp else "")
        rows.append({"messages": [{"role": "user", "content": user},
                                  {"role": "assistant", "content": good if desirable else bad}],
                     "label": desirable})
    return rows


# ---------------------------------------------------------------------------------------------
# c4_demo: short plain-text paragraphs for pre-training
# ---------------------------------------------------------------------------------------------
PARAGRAPHS = [
    "Bread is made from flour, water, salt and yeast. The yeast feeds on sugars in the dough and releases carbon dioxide, which makes the dough rise. Baking sets the structure and browns the crust.",
    "A good night's sleep helps memory and mood. Most adults need between seven and nine hours, and keeping a regular bedtime makes it easier to fall asleep.",
    "Bicycles are one of the most efficient ways to travel short distances. A rider turns the pedals, a chain carries the motion to the rear wheel, and gears let the rider trade speed for effort.",
    "Honeybees live in colonies with a single queen, thousands of female workers and, in summer, some male drones. Workers collect nectar and pollen and turn the nectar into honey.",
    "Version control systems record every change to a set of files. They let a team work on the same project, compare versions, and go back to an earlier state when something breaks.",
    "Tea is brewed from the leaves of the Camellia sinensis plant. Green, black and oolong teas come from the same plant; they differ in how the leaves are processed after picking.",
    "The water cycle moves water between the oceans, the air and the land. Water evaporates, condenses into clouds, falls as rain or snow, and flows back to the sea through rivers and groundwater.",
    "A budget starts with a list of income and expenses for a month. Writing down where money goes makes it easier to notice small costs that add up.",
    "Composting turns kitchen scraps and garden waste into a dark, crumbly soil conditioner. It needs a mix of green material, brown material, air and a little moisture.",
    "The library on Elm Street added a tool lending shelf this spring. Members can borrow drills, ladders and garden tools for a week, the same way they borrow books.",
    "Unit tests check small pieces of code in isolation. A test that can never fail gives false confidence, so a good test is written to fail first and pass once the code is right.",
    "Maps use a scale to show how distances on paper relate to distances on the ground. On a map with a scale of 1 to 50,000, one centimeter stands for half a kilometer.",
    "Walking for thirty minutes a day is a simple habit with real benefits for the heart, the joints and the mind. It needs no equipment beyond comfortable shoes.",
    "Spreadsheets arrange data in rows and columns. Formulas let one cell depend on others, so changing a single number updates every total that uses it.",
    "The old bridge over the river was closed for repairs in March. Engineers replaced the worn bearings and repainted the steel to protect it from rust.",
    "Learning to touch type takes a few weeks of short daily practice. Accuracy comes first; speed follows once the fingers know where the keys are.",
    "Rice is a staple food for more than half of the world's people. It grows best in warm, wet conditions, and many varieties are cultivated in flooded fields called paddies.",
    "A recipe is a small program for the kitchen: a list of inputs, a sequence of steps, and a result. Like code, it works best when each step is clear and measured.",
    "Solar panels convert sunlight directly into electricity using layers of semiconductor material. Their output depends on the angle of the sun, the weather and how clean the panels are.",
    "Chess is played on a board of sixty-four squares. Each player starts with sixteen pieces, and the game ends when one king is checkmated or the players agree to a draw.",
]


def make_c4(rng: random.Random, n: int = 100) -> list[dict]:
    rows = [{"text": p} for p in PARAGRAPHS]
    i = 0
    while len(rows) < n:
        kind = i % 4
        if kind == 0:
            country, capital, _, _ = CAPITALS[(i // 4) % len(CAPITALS)]
            text = (f"{capital} is the capital of {country}. Like many capital cities, it is home to the national "
                    f"government, and visitors come to see its museums, markets and historic streets.")
        elif kind == 1:
            name, symbol, number, _ = ELEMENTS[(i // 4) % len(ELEMENTS)]
            text = (f"{name.capitalize()} is a chemical element with the symbol {symbol} and atomic number {number}. "
                    f"Its atomic number is the number of protons in the nucleus of each of its atoms.")
        elif kind == 2:
            idx = (i // 4) % len(PLANETS)
            ordinal = ["first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth"][idx]
            text = (f"{PLANETS[idx]} is the {ordinal} planet from the Sun. "
                    + ("It is one of the four rocky inner planets." if idx < 4 else "It is one of the four giant outer planets."))
        else:
            city, country, river = RIVERS[(i // 4) % len(RIVERS)]
            text = (f"The {river} flows through {city}, in {country}. Rivers have shaped cities for centuries, "
                    f"providing water, transport and, today, places to walk along the banks.")
        rows.append({"text": text})
        i += 1
    return rows[:n]


# ---------------------------------------------------------------------------------------------
# a small CSV example, so users see that csv files work too
# ---------------------------------------------------------------------------------------------
def write_csv_demo(path: Path, rng: random.Random, n: int = 20) -> None:
    with path.open("w", encoding="utf-8", newline="") as f:
        w = csv.writer(f)
        w.writerow(["question", "answer"])
        for _ in range(n):
            row = en_conversion(rng)
            w.writerow([row["instruction"], row["output"]])


# ---------------------------------------------------------------------------------------------
BUNDLED_INFO = {
    # probe_question: what the Chat tab suggests asking an adapter trained on this set (both are in identity.json)
    "identity": {"file_name": "identity.json", "probe_question": {"en": "Who are you?", "zh": "你是谁？"}},
    "alpaca_en_demo": {"file_name": "alpaca_en_demo.json"},
    "alpaca_zh_demo": {"file_name": "alpaca_zh_demo.json"},
    "extraction_demo": {"file_name": "extraction_demo.json",
                        "columns": {"prompt": "instruction", "query": "input", "response": "output"}},
    "toolcall_demo": {"file_name": "toolcall_demo.json", "formatting": "sharegpt",
                      "columns": {"messages": "conversations", "system": "system", "tools": "tools"}},
    "sharegpt_multiturn_demo": {"file_name": "sharegpt_multiturn_demo.json", "formatting": "sharegpt",
                                "columns": {"messages": "conversations", "system": "system"}},
    "openai_demo": {"file_name": "openai_demo.json", "formatting": "openai",
                    "columns": {"messages": "messages", "tools": "tools"},
                    "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                             "assistant_tag": "assistant", "observation_tag": "tool", "system_tag": "system"}},
    "dpo_en_demo": {"file_name": "dpo_en_demo.json", "ranking": True,
                    "columns": {"prompt": "instruction", "query": "input", "chosen": "chosen", "rejected": "rejected"}},
    "kto_en_demo": {"file_name": "kto_en_demo.jsonl", "formatting": "sharegpt",
                    "columns": {"messages": "messages", "kto_tag": "label"},
                    "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}},
    "c4_demo": {"file_name": "c4_demo.jsonl", "columns": {"prompt": "text"}},
    "csv_demo": {"file_name": "csv_demo.csv", "columns": {"prompt": "question", "response": "answer"}},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "data")
    out: Path = parser.parse_args().out
    out.mkdir(parents=True, exist_ok=True)
    # One generator per dataset, so changing one dataset never reshuffles the others.
    dump_json(out / "identity.json", make_identity())
    dump_json(out / "alpaca_en_demo.json", make_alpaca_en(random.Random(101)))
    dump_json(out / "alpaca_zh_demo.json", make_alpaca_zh(random.Random(102)))
    dump_json(out / "extraction_demo.json", make_extraction(random.Random(103)))
    rng = random.Random(104)
    dump_json(out / "toolcall_demo.json", [toolcall_row(rng, i) for i in range(48)])
    rng = random.Random(105)
    dump_json(out / "sharegpt_multiturn_demo.json", [multiturn_row(rng, i) for i in range(30)])
    rng = random.Random(106)
    dump_json(out / "openai_demo.json", [openai_row(rng, i) for i in range(20)])
    dump_json(out / "dpo_en_demo.json", make_dpo(random.Random(107)))
    dump_jsonl(out / "kto_en_demo.jsonl", make_kto(random.Random(108)))
    dump_jsonl(out / "c4_demo.jsonl", make_c4(random.Random(109)))
    write_csv_demo(out / "csv_demo.csv", random.Random(110))

    info_path = out / "dataset_info.json"
    info = json.loads(info_path.read_text(encoding="utf-8")) if info_path.exists() else {}
    merged = dict(BUNDLED_INFO)
    merged.update({k: v for k, v in info.items() if k not in BUNDLED_INFO})  # keep users' entries
    info_path.write_text(json.dumps(merged, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {len(BUNDLED_INFO)} bundled datasets to {out}")


if __name__ == "__main__":
    main()
