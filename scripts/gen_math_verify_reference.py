#!/usr/bin/env python3
"""Reference verdicts of TRL's `accuracy_reward` (trl 1.16 with math-verify 0.9) for the
built-in `math_accuracy` reward and grpo-rewards' `math_verify` module.

Writes tests/tests/data/math_verify_reference.json: solutions in the forms math datasets hold
them (bare numbers, `$...$` LaTeX, whole worked solutions ending in `\\boxed{}`, GSM8K's
`####`) against completions that state an equal, an equivalent or a wrong answer in the ways
models write them (`\\boxed{}`, "the answer is $...$", "Final answer: ...", units, percents,
decimals, reordered sets, equations, several boxes, no LaTeX at all), each with the reward
TRL's own function returns (`null`: the solution could not be parsed) and what math_verify
parsed on both sides.

    pip install trl==1.16.0 math-verify==0.9.0
    python3 scripts/gen_math_verify_reference.py [--seed S] [--random N] [--out FILE]

Another seed or more random cases make a fresh set to check against without committing it:
`MATH_VERIFY_REFERENCE=FILE cargo test -p grpo-tests --test it math_verify::`.
"""
import argparse
import json
import pathlib
import random

from latex2sympy2_extended import NormalizationConfig
from math_verify import LatexExtractionConfig, parse
from trl.rewards import accuracy_reward

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests/tests/data/math_verify_reference.json"

# (gold LaTeX, equivalent forms, wrong forms)
ANSWERS = [
    ("42", ["42", "42.0", "4 2", "42 \\text{ apples}", "x = 42", "{42}", "042"], ["41", "24", "-42", "42.5"]),
    ("-7", ["-7", "- 7", "-7.0", "-\\frac{14}{2}"], ["7", "-6"]),
    ("1000", ["1000", "1,000", "1{,}000", "1000.00", "10^3", "10^{3}"], ["100", "1001"]),
    ("\\frac{3}{4}", ["\\frac{3}{4}", "\\dfrac{3}{4}", "0.75", "\\frac{6}{8}", "3/4", "\\tfrac34", "\\frac34"], ["\\frac{4}{3}", "0.7", "\\frac{3}{5}"]),
    ("\\frac{1}{3}", ["\\frac{1}{3}", "0.333333", "\\frac{2}{6}", "1/3"], ["0.33", "\\frac{1}{4}"]),
    ("0.5", ["0.5", "\\frac{1}{2}", "\\frac12", ".5", "50\\%"], ["0.25", "5"]),
    ("3\\sqrt{2}", ["3\\sqrt{2}", "\\sqrt{18}", "3 \\sqrt 2", "\\sqrt{2} \\cdot 3", "4.242640687"], ["2\\sqrt{3}", "\\sqrt{6}", "4.24"]),
    ("\\frac{\\pi}{4}", ["\\frac{\\pi}{4}", "\\pi/4", "\\frac{1}{4}\\pi", "0.785398"], ["\\frac{\\pi}{2}", "\\pi"]),
    ("2^{10}", ["2^{10}", "1024", "4^5"], ["2^{9}", "1000"]),
    ("x^2+2x+1", ["x^2+2x+1", "(x+1)^2", "1+2x+x^2", "x^{2} + 2 x + 1"], ["x^2+1", "(x-1)^2", "x^2+2x"]),
    ("2x+3", ["2x+3", "3+2x", "2 \\cdot x + 3", "y = 2x+3"], ["2x-3", "3x+2"]),
    ("\\frac{x}{2}", ["\\frac{x}{2}", "x/2", "0.5x", "\\frac{1}{2}x"], ["2x", "\\frac{2}{x}"]),
    ("(1, 2)", ["(1, 2)", "(1,2)", "\\left(1, 2\\right)"], ["(2, 1)", "[1, 2]", "(1, 3)"]),
    ("[0, 1)", ["[0, 1)", "[0,1)"], ["(0, 1)", "[0, 1]", "[0, 2)"]),
    ("(-\\infty, 2]", ["(-\\infty, 2]", "(-\\infty,2]"], ["(-\\infty, 2)", "[2, \\infty)"]),
    ("\\{1, 2, 3\\}", ["\\{1, 2, 3\\}", "\\{3, 2, 1\\}", "1, 2, 3", "3, 1, 2"], ["\\{1, 2\\}", "\\{1, 2, 4\\}"]),
    ("x = 3", ["x = 3", "3", "x=3", "3.0"], ["x = 4", "4", "y = 4"]),
    ("10\\%", ["10\\%", "10", "10 \\%", "0.1", "10 percent"], ["20\\%", "1"]),
    ("5 \\text{ cm}", ["5 \\text{ cm}", "5", "5\\text{cm}", "5 cm"], ["6 \\text{ cm}", "50"]),
    ("\\infty", ["\\infty", "+\\infty"], ["-\\infty", "0"]),
    ("12", ["12", "\\$12", "12 \\text{ dollars}", "12.00"], ["13", "1.2"]),
    ("\\sqrt{5}", ["\\sqrt{5}", "5^{1/2}", "\\sqrt 5", "2.2360679775"], ["5", "\\sqrt{6}", "2.23"]),
    ("\\frac{5}{2}", ["\\frac{5}{2}", "2.5", "2\\frac{1}{2}", "\\frac{10}{4}"], ["\\frac{2}{5}", "3"]),
    ("2, 5", ["2, 5", "5, 2", "2 \\text{ and } 5", "x = 2, x = 5"], ["2", "2, 6"]),
    ("\\text{(B)}", ["\\text{(B)}", "B", "(B)", "\\textbf{(B)}"], ["A", "\\text{(C)}"]),
    ("\\pi", ["\\pi", "3.14159265"], ["3.14", "2\\pi"]),
    ("e^2", ["e^2", "e^{2}", "7.3890561"], ["e^3", "2e"]),
    ("\\log_2 8", ["\\log_2 8", "3", "\\log_{2}{8}"], ["2", "8"]),
    ("x < 5", ["x < 5", "5 > x", "(-\\infty, 5)"], ["x \\le 5", "x > 5"]),
    ("120", ["120", "5!", "\\binom{10}{3}", "120^\\circ"], ["60", "24"]),
    ("\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}",
     ["\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}", "\\begin{bmatrix} 1 & 2 \\\\ 3 & 4 \\end{bmatrix}",
      "\\left[\\begin{array}{cc} 1 & 2 \\\\ 3 & 4 \\end{array}\\right]",
      "\\begin{pmatrix} 1 & 0 \\\\ 0 & 1 \\end{pmatrix} \\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}"],
     ["\\begin{pmatrix} 1 & 3 \\\\ 2 & 4 \\end{pmatrix}", "\\begin{pmatrix} 1 & 2 \\end{pmatrix}"]),
    ("3:4", ["3:4", "\\frac{3}{4}", "0.75", "AB:CD = 3:4"], ["4:3", "3:5"]),
    ("x \\neq 2", ["x \\neq 2", "x != 2", "x \\ne 2"], ["x \\neq 3", "x = 2"]),
    ("(a, b) = (2, 5)", ["(2, 5)", "(a,b)=(2,5)"], ["(5, 2)", "(2, 6)"]),
    ("2x + 3y = 6", ["2x+3y=6", "y = 2 - \\frac{2}{3}x", "4x + 6y = 12", "3y + 2x - 6 = 0"], ["2x + 3y = 5", "y = 2x"]),
    ("(-\\infty, 0) \\cup (1, \\infty)", ["(-\\infty,0)\\cup(1,\\infty)", "x \\in (-\\infty, 0) \\cup (1, \\infty)"],
     ["(0, 1)", "(-\\infty, 1)"]),
    ("p = 2, q = 3; p = 3, q = 2", ["(2, 3), (3, 2)", "(3, 2), (2, 3)"], ["(2, 3)", "(2, 2), (3, 3)"]),
    ("3.14", ["x \\approx 3.14", "\\pi \\approx 3.14", "3.140"], ["x \\approx 3.15", "\\pi"]),
    ("\\sum_{k=1}^{4} k^2", ["30", "\\sum_{j=1}^{4} j^2", "1 + 4 + 9 + 16"], ["\\sum_{k=1}^{5} k^2", "29"]),
    ("|x| \\le 2", ["[-2, 2]", "-2 \\le x \\le 2", "x \\in [-2, 2]"], ["[0, 2]", "(-2, 2)"]),
    ("1 < |y| \\le 3", ["[-3, -1) \\cup (1, 3]", "y \\in [-3,-1) \\cup (1,3]"], ["(1, 3]", "[-3, -1] \\cup [1, 3]"]),
]

WRAPPERS = [
    ("\\boxed{{{}}}", True),
    ("The answer is $\\boxed{{{}}}$.", True),
    ("So the answer is ${}$.", True),
    ("Final answer: ${}$", True),
    ("**Answer:** ${}$", True),
    ("Therefore, the final answer is $\\boxed{{{}}}$. I hope it is correct.", True),
    ("We get \\[ \\boxed{{{}}} \\]", True),
    ("$${}$$", False),
    ("The result is ${}$.", False),
    ("The answer is {}", False),
    ("{}", False),
    ("answer: \\({}\\)", True),
    ("First I thought \\boxed{{0}}, but the answer is \\boxed{{{}}}", True),
    ("The answer is \\boxed{{{}}} and not \\boxed{{0}}.", True),
    ("<think>\nLet me compute.\n</think>\nThe answer is $\\boxed{{{}}}$", True),
]

SOLUTIONS = [
    "{}",
    "${}$",
    "So we find that the value is $\\boxed{{{}}}$.",
    "Working it out step by step gives \\[ {} \\]",
    "The total is 3 + 4 = 7, so the answer is \\boxed{{{}}}.",
    "Reasoning here.\n#### {}",
]


def random_atom(rng):
    k = rng.randrange(12)
    if k == 0:
        return str(rng.randint(-20, 100))
    if k == 1:
        return f"{rng.uniform(-50, 50):.{rng.randint(1, 4)}f}"
    if k == 2:
        return rng.choice(["\\frac", "\\dfrac", "\\tfrac"]) + "{%d}{%d}" % (rng.randint(-9, 30), rng.randint(1, 12))
    if k == 3:
        return "%d/%d" % (rng.randint(1, 30), rng.randint(1, 12))
    if k == 4:
        return rng.choice(["", "2", "3", "-"]) + "\\sqrt{%d}" % rng.randint(2, 50)
    if k == 5:
        return rng.choice(["\\pi", "2\\pi", "\\frac{\\pi}{%d}" % rng.randint(2, 6), "e", "e^{2}"])
    if k == 6:
        return rng.choice(["x", "y", "n", "a", "b", "t"])
    if k == 7:
        return "%d%s" % (rng.randint(2, 9), rng.choice(["x", "y", "n", "\\pi", "\\sqrt{2}"]))
    if k == 8:
        return "%d^{%d}" % (rng.randint(2, 10), rng.randint(2, 5))
    if k == 9:
        return rng.choice(["\\sqrt[3]{%d}" % rng.choice([8, 27, 10, 64]), "\\log_{2} %d" % rng.choice([8, 16, 10]),
                           "\\ln %d" % rng.randint(2, 9), "%d!" % rng.randint(3, 7), "\\binom{%d}{%d}" % (rng.randint(4, 9), rng.randint(1, 3))])
    if k == 10:
        return rng.choice(["\\infty", "-\\infty", "0", "1", "-1"])
    return "%d%%" % rng.randint(1, 100) if rng.random() < 0.3 else str(rng.randint(0, 999))


def random_expr(rng, depth=0):
    if depth > 1 or rng.random() < 0.45:
        return random_atom(rng)
    a, b = random_expr(rng, depth + 1), random_expr(rng, depth + 1)
    op = rng.choice(["+", "-", "\\cdot", "", "/", "^", "frac", "paren"])
    if op == "frac":
        return "\\frac{%s}{%s}" % (a, b)
    if op == "^":
        return "(%s)^{%d}" % (a, rng.randint(2, 3))
    if op == "paren":
        return "(%s)(%s)" % (a, b)
    if op == "":
        return a + " " + b
    return f"{a} {op} {b}"


def random_answer(rng):
    k = rng.randrange(10)
    if k < 5:
        return random_expr(rng)
    if k == 5:
        xs = [random_atom(rng) for _ in range(rng.randint(2, 4))]
        return rng.choice(["\\{%s\\}", "%s", "(%s)", "[%s]"]) % ", ".join(xs)
    if k == 6:
        lo, hi = sorted(rng.sample(range(-10, 10), 2))
        return rng.choice("([") + f"{lo}, {hi}" + rng.choice(")]")
    if k == 7:
        return f"{rng.choice(['x', 'y', 'k'])} = {random_expr(rng)}"
    if k == 8:
        relation = rng.choice(["<", ">", "\\le", "\\geq"])
        return f"{rng.choice(['x', 'y'])} {relation} {rng.randint(-9, 9)}"
    return rng.choice(["\\text{(A)}", "B", "\\textbf{(C)}", "\\text{yes}", "no", "\\text{even}"]) 


def variant(rng, latex):
    """The same answer written another way, or another answer."""
    k = rng.randrange(9)
    if k == 0:
        return latex
    if k == 1:
        return latex.replace(" ", "")
    if k == 2:
        return latex.replace("\\frac", "\\dfrac").replace("\\cdot", "\\times")
    if k == 3:
        parts = latex.split(", ")
        rng.shuffle(parts)
        return ", ".join(parts)
    if k == 4:
        parts = latex.split(" + ")
        rng.shuffle(parts)
        return " + ".join(parts)
    if k == 5:
        try:
            from sympy import N
            from latex2sympy2_extended import latex2sympy
            value = N(latex2sympy(latex))
            return f"{float(value):.{rng.choice([2, 4, 6, 8])}f}"
        except Exception:
            return latex
    if k == 6:
        return random_answer(rng)
    if k == 7:
        return "%s \\text{ %s}" % (latex, rng.choice(["cm", "units", "dollars", "m^2", "degrees"]))
    return "x = " + latex


def msg(text):
    return [{"role": "assistant", "content": text}]


def parsed(xs):
    return [str(x) for x in xs]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--random", type=int, default=2500)
    ap.add_argument("--out", type=pathlib.Path, default=OUT)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    answer_config = [LatexExtractionConfig(normalization_config=NormalizationConfig(units=True),
                                           boxed_match_priority=0, try_extract_without_anchor=False)]
    cases = []
    for gold, equal, wrong in ANSWERS:
        for form in SOLUTIONS:
            for said in equal + wrong:
                wrapper, _ = rng.choice(WRAPPERS)
                cases.append((form.format(gold), wrapper.format(said)))
        for wrapper, _ in WRAPPERS:
            cases.append((rng.choice(SOLUTIONS).format(gold), wrapper.format(rng.choice(equal))))
    # Random noise around answers: text before and after, several formulas, stray dollars.
    noise = ["Let $x$ be the number.", "We have $2+2=4$.", "Hmm, $\\frac{1}{2}$ of it.", "Answer",
             "the answer", "final answer is", ":", "$", "\\boxed{", "}", "\n", " ", "so", "="]
    for _ in range(300):
        gold, equal, wrong = rng.choice(ANSWERS)
        said = rng.choice(equal + wrong)
        pieces = [rng.choice(noise) for _ in range(rng.randint(0, 4))]
        pieces.insert(rng.randint(0, len(pieces)), rng.choice(WRAPPERS)[0].format(said))
        cases.append((rng.choice(SOLUTIONS).format(gold), " ".join(pieces)))

    # Random answers: expressions, sets, intervals, equations, choices; the completion states the
    # same answer, the same written otherwise, its decimal value, or another one.
    for _ in range(args.random):
        gold = random_answer(rng)
        said = variant(rng, gold)
        wrapper = rng.choice(WRAPPERS)[0]
        completion = wrapper.format(said)
        if rng.random() < 0.3:
            completion = rng.choice(noise) + " " + completion + " " + rng.choice(noise)
        cases.append((rng.choice(SOLUTIONS).format(gold), completion))

    out = []
    for solution, completion in cases:
        try:
            reward = accuracy_reward([msg(completion)], [solution])[0]
            gold = parse(solution, parsing_timeout=None)
            answer = parse(completion, extraction_config=answer_config, extraction_mode="first_match",
                           parsing_timeout=None)
            gold, answer = parsed(gold), parsed(answer)
        except Exception:  # TRL itself fails on the case (SymPy printing 1/0); not a reference
            continue
        out.append({"solution": solution, "completion": completion, "reward": reward,
                    "gold_parsed": gold, "answer_parsed": answer})
    args.out.write_text(json.dumps({"trl": "1.16.0", "cases": out}, indent=1, ensure_ascii=False) + "\n")
    rewards = [c["reward"] for c in out]
    print(f"{len(out)} cases: {rewards.count(1.0)} correct, {rewards.count(0.0)} wrong, "
          f"{rewards.count(None)} unparseable solutions -> {args.out}")


if __name__ == "__main__":
    main()
