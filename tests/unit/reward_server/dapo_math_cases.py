"""Golden cases for the DAPO rule reward: (response, ground_truth, acc, pred).

Written by hand from the reference's rules (verl math_dapo.compute_score); `test_dapo_math.py`
checks each against our code and, when the verl wheel is available, against the reference itself.
"""

FILLER = "Let me work through this carefully, one step at a time, and check each step. " * 5  # 380 chars

CASES: list[tuple[str, str, bool, str]] = [
    # --- plain integers, the common case
    ("Answer: 42", "42", True, "42"),
    ("Answer: 41", "42", False, "41"),
    ("2 + 40 = 42\nAnswer: 42", "42", True, "42"),
    ("Step 1: 6 * 7 = 42.\nAnswer: 42\n", "42", True, "42"),
    ("Answer: 0", "0", True, "0"),
    ("Answer: -3", "-3", True, "-3"),
    ("Answer: −3", "-3", False, "−3"),  # unicode minus is not '-'
    ("Answer: +3", "3", False, "+3"),
    ("Answer: 007", "7", False, "007"),
    ("Answer: 3.0", "3", False, "3.0"),
    ("Answer: 5.", "5", False, "5."),
    ("Answer: 5", "5.", False, "5"),
    # --- the marker: case, spacing, position
    ("answer: 42", "42", True, "42"),
    ("ANSWER: 42", "42", True, "42"),
    ("AnSwEr: 42", "42", True, "42"),
    ("Answer : 42", "42", True, "42"),
    ("Answer:42", "42", True, "42"),
    ("Answer:    42", "42", True, "42"),
    ("Answer:\n42", "42", True, "42"),  # \s* crosses the newline
    ("The final answer: 9", "9", True, "9"),
    ("Final Answer: 9", "9", True, "9"),
    ("**Answer:** 9", "9", False, "**9"),
    ("Answer: 9 because 4 + 5 = 9", "9", True, "9"),  # text after the last '=' is kept
    ("Answer: 9 because four plus five", "9", False, "9becausefourplusfive"),
    ("Answer: 9\nThat is all.", "9", True, "9"),
    ("Answer = 9", "9", False, "[INVALID]"),
    ("The answer is 9", "9", False, "[INVALID]"),
    ("Answer:", "9", False, "[INVALID]"),
    ("", "9", False, "[INVALID]"),
    # --- several answers: the last one counts
    ("Answer: 1\nAnswer: 2", "2", True, "2"),
    ("Answer: 1\nAnswer: 2", "1", False, "2"),
    ("Answer: 2\nWait, that is wrong.\nAnswer: 3", "3", True, "3"),
    ("answer: 7\nANSWER: 8", "8", True, "8"),
    ("Answer: 1 Answer: 2", "2", False, "1Answer:2"),  # one line: the capture runs to the newline
    # --- only the last 300 characters count
    ("Answer: 5\n" + FILLER, "5", False, "[INVALID]"),
    (FILLER + "\nAnswer: 5", "5", True, "5"),
    ("Answer: 4\n" + FILLER + "\nAnswer: 5", "5", True, "5"),
    ("Answer: 5\n" + "x" * 289, "5", True, "5"),
    ("Answer: 5\n" + "x" * 290, "5", True, "5"),  # 300 characters exactly
    ("Answer: 5\n" + "x" * 291, "5", False, "[INVALID]"),  # the 'A' falls off
    # --- units and words the normaliser removes
    ("Answer: 42 dollars", "42", True, "42"),
    ("Answer: $42", "42", True, "42"),
    ("Answer: \\$42", "42", True, "42"),
    ("Answer: 5 cm", "5", True, "5"),
    ("Answer: 5 meters", "5", True, "5"),
    ("Answer: 12 inches", "12", True, "12"),
    ("Answer: 3 hours", "3", True, "3"),
    ("Answer: 90 degrees", "90", True, "90"),
    ("Answer: 90^\\circ", "90", True, "90"),
    ("Answer: 90^{\\circ}", "90", True, "90"),
    ("Answer: 60 mph", "60", True, "60"),
    ("Answer: 7 students", "7", True, "7"),
    ("Answer: 15 points", "15", True, "15"),
    ("Answer: 8 units", "8", True, "8"),
    ("Answer: 25 cents", "25", True, "25"),
    ("Answer: 4 feet", "4", True, "4"),
    ("Answer: 10 minutes", "10", True, "10"),
    ("Answer: 6 ways", "6", True, "6"),
    ("Answer: 3 integers", "3", True, "3"),
    ("Answer: 9 pounds", "9", True, "9"),
    ("Answer: 2 km", "2", True, "2"),
    ("Answer: 16 square", "16", True, "16"),
    ("Answer: 5 apples", "5", False, "5apples"),
    ("Answer: a 5", "5", True, "5"),
    ("Answer: an 8", "8", True, "8"),
    ("Answer: 3rd", "3", False, "3rd"),
    ("Answer: 3^\\mathrm{th}", "3", False, "3^"),
    # --- LaTeX
    ("Answer: $\\frac{1}{2}$", "\\frac{1}{2}", True, "\\frac{1}{2}"),
    ("Answer: \\frac{1}{2}", "\\frac12", True, "\\frac{1}{2}"),
    ("Answer: \\frac12", "\\frac{1}{2}", True, "\\frac{1}{2}"),
    ("Answer: \\dfrac{1}{2}", "\\frac{1}{2}", False, "\\dfrac{1}{2}"),
    ("Answer: 1/2", "\\frac{1}{2}", False, "1/2"),
    ("Answer: 0.5", "\\frac{1}{2}", False, "0.5"),
    ("Answer: \\sqrt{2}", "\\sqrt2", True, "\\sqrt{2}"),
    ("Answer: 3\\sqrt2", "3\\sqrt{2}", True, "3\\sqrt{2}"),
    ("Answer: \\text{(A)}", "(A)", True, "(A)"),
    ("Answer: \\textbf{(B)}", "(B)", True, "(B)"),
    ("Answer: \\overline{AB}", "AB", True, "AB"),
    ("Answer: \\boxed{7}", "7", True, "7"),
    ("Answer: $\\boxed{7}$", "7", True, "7"),
    ("Answer: $x = 5$", "5", True, "5"),
    ("Answer: x = 5", "5", True, "5"),
    ("Answer: $5$ and $6$", "5", True, "5"),  # only the first $...$ span is kept
    ("Answer: $5$ and $6$", "6", False, "5"),
    ("Answer: \\pi", "\\pi", True, "\\pi"),
    ("Answer: 2\\pi", "2\\pi", True, "2\\pi"),
    ("Answer: \\infty", "\\infty", True, "\\infty"),
    ("Answer: (1, 2)", "(1,2)", True, "(1,2)"),
    ("Answer: [0, 1)", "[0,1)", True, "[0,1)"),
    ("Answer: 1, 2, 3", "1,2,3", True, "123"),  # digits-and-commas collapse on both sides
    ("Answer: \\{1, 2\\}", "\\{1,2\\}", True, "\\{1,2\\}"),
    ("Answer: x^2 + 1", "x^2+1", True, "x^2+1"),
    ("Answer: x^2+1", "1+x^2", False, "x^2+1"),
    ("Answer: 10\\%", "10", False, "10\\%"),
    ("Answer: 10\\%", "10\\%", True, "10\\%"),
    ("Answer: 5\\;\\text{cm}", "5", True, "5"),
    ("Answer: \\text{5 cm}", "5", True, "5"),
    ("Answer: 2\\text{ and }3", "2,3", True, "23"),  # \text{and} -> ',' then digits-and-commas collapse
    # --- thousands separators
    ("Answer: 1,000", "1000", True, "1000"),
    ("Answer: 1000", "1,000", True, "1000"),
    ("Answer: 1,000,000", "1000000", True, "1000000"),
    ("Answer: 12,345", "12345", True, "12345"),
    ("Answer: 1{,}000", "1000", True, "1000"),
    ("Answer: 1,000.5", "1000.5", False, "1,000.5"),
    ("Answer: $1,000", "1000", True, "1000"),
    ("Answer: 1 000", "1000", True, "1000"),
    # --- boxed fallback (no Answer: line): raw content vs raw ground truth
    ("The answer is \\boxed{42}", "42", True, "42"),
    ("The answer is \\boxed{42}.", "42", True, "42"),
    ("\\boxed{41}", "42", False, "41"),
    ("\\boxed{ 42}", "42", False, " 42"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", True, "\\frac{1}{2}"),
    ("\\boxed{\\frac12}", "\\frac{1}{2}", False, "\\frac12"),  # no normalisation on this path
    ("\\boxed{1,000}", "1000", False, "1,000"),
    ("\\boxed{42 dollars}", "42", False, "42 dollars"),
    ("First \\boxed{1}, then \\boxed{2}", "2", True, "2"),
    ("\\boxed{2} and later \\boxed{3}", "2", False, "3"),
    ("\\boxed{\\text{(C)}}", "\\text{(C)}", True, "\\text{(C)}"),
    ("\\boxed{{7}}", "{7}", True, "{7}"),
    ("\\boxed{7", "7", False, "[INVALID]"),  # unbalanced: no box
    ("\\boxed {7}", "7", False, "[INVALID]"),
    ("\\fbox{7}", "7", False, "[INVALID]"),
    ("\\boxed{7}" + "." * 91, "7", True, "7"),  # 100 characters exactly
    ("\\boxed{7}" + "." * 92, "7", False, "[INVALID]"),  # the box starts before the last 100
    ("Answer: 5\n\\boxed{6}", "6", False, "5"),  # an Answer: line wins over a box
    ("Answer: \n\\boxed{6}", "6", True, "6"),  # the Answer: capture is the boxed line
    ("I think it's \\boxed{}", "", True, ""),
    # --- ground truths that need normalising
    ("Answer: 5", "x = 5", True, "5"),
    ("Answer: 5", "$5$", True, "5"),
    ("Answer: 5", "5 dollars", True, "5"),
    ("Answer: 5", "\\boxed{5}", True, "5"),
    ("Answer: 5", "\\text{5}", True, "5"),
    ("Answer: 5", " 5 ", True, "5"),
    ("Answer: 12", "12,", True, "12"),  # a trailing comma vanishes with the digits-and-commas rule
    # --- odd inputs
    ("Answer: [INVALID]", "[INVALID]", True, "[INVALID]"),
    ("Answer: [INVALID]\n\\boxed{3}", "3", True, "3"),  # an Answer: that normalises to [INVALID] falls back
    ("Answer: ∞", "∞", True, "∞"),
    ("Answer: 四十二", "四十二", True, "四十二"),
    ("Answer: 42\r\n", "42", True, "42"),  # strip() takes the \r
    ("Answer:\t42", "42", True, "42"),
    ("Answer: " + "9" * 250, "9" * 250, True, "9" * 250),
    ("Answer: " + "9" * 300, "9" * 300, False, "[INVALID]"),  # the marker is beyond the last 300
    ("\n\n\nAnswer: 1\n\n\n", "1", True, "1"),
    ("<answer>5</answer>", "5", False, "[INVALID]"),
    ("answer:5 answer:6\nanswer:7", "7", True, "7"),
    ("ANSWER:2\nanswer:3", "2", False, "3"),
    ("Answer: 1/3", "1/3", True, "1/3"),
    ("Answer: 2^{10}", "1024", False, "2^{10}"),
    ("Answer: \\frac{3}{4}", "\\frac34", True, "\\frac{3}{4}"),
    ("Answer: 7 edges", "7", True, "7"),
    ("Answer: 4 digits", "4", True, "4"),
    ("Answer: 11 meals", "11", True, "11"),
    ("Answer: \\text{Monday}", "Monday", True, "Monday"),
    ("Answer: 3 \\ldots", "3", True, "3"),
    ("Answer: -\\frac{1}{2}", "-\\frac{1}{2}", True, "-\\frac{1}{2}"),
    ("Answer: 5 \n\n\\boxed{5}", "5", True, "5"),
]
