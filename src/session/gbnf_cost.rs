//! What a GBNF grammar will cost llama.cpp, checked before llama.cpp sees
//! it. llama.cpp's grammar code has three costs no cap on a schema bounds:
//!
//! - a repetition `{m,n}` with `m > n` makes its parser add rules until
//!   memory runs out (`n - m` wraps as an unsigned count);
//! - its left-recursion check walks every rule's leftmost references again
//!   for each path that reaches them (no memo), so `anyOf` chains of
//!   shared `$ref`s double the walk at every level;
//! - its first parse stacks are kept in a list searched linearly, so a run
//!   of thousands of optional items (`(a?){1000}` in a `pattern`) takes a
//!   quadratic time before the first token.
//!
//! Each runs inside the worker's step, where it stalls every generation on
//! the lane. [`check`] reads the grammar as llama.cpp's parser does (groups
//! and repetitions become rules, as there) and replays the walk and the
//! first stacks under caps, stopping at the cap: a few milliseconds at
//! most. A left recursion, which llama.cpp refuses with no reason given,
//! is refused here in words. Pure: GBNF in, the first limit it breaks out,
//! named.

use std::collections::HashMap;

/// The most grammar elements once repetitions are written out (256
/// properties of `maxLength: 1000`, the schema caps' most, are about a
/// million; 48 strings of that took llama.cpp 0.05 s to the first token).
pub const MAX_ELEMENTS: usize = 2_000_000;
/// The most steps of llama.cpp's left-recursion walk (about 10 ms there).
pub const MAX_WALK: u64 = 2_000_000;
/// The deepest nesting of rules (groups in groups, rules whose leftmost
/// item is a rule, a parse stack's length): llama.cpp recurses once a
/// level.
pub const MAX_NESTING: usize = 1_000;
/// The most parse stacks llama.cpp builds at once (before the first token,
/// or after a character).
pub const MAX_STACKS: usize = 20_000;
/// The most ways a repetition of an item that can match nothing can stand
/// after a character (`([a-z]{0,30}){0,30}`: any of 30 x 30 places at
/// once; llama.cpp checks every vocabulary token against each). 100 took
/// 35 ms a token on SmolLM2's 49,152 tokens, 200 about 1 s, 900 29 s.
pub const MAX_AMBIGUITY: u64 = 128;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Sym {
    /// A character, a class, any character or a token: matched, not
    /// expanded.
    Term,
    Ref(usize),
}

type Alt = Vec<Sym>;

struct Grammar {
    rules: Vec<Vec<Alt>>,
    names: HashMap<String, usize>,
    elements: usize,
    /// Each repetition's outermost optional rule: (the item repeated, its
    /// optional copies).
    chains: HashMap<usize, (Alt, u64)>,
}

impl Grammar {
    fn id(&mut self, name: &str) -> usize {
        if let Some(&id) = self.names.get(name) {
            return id;
        }
        let id = self.rules.len();
        self.rules.push(Vec::new());
        self.names.insert(name.to_owned(), id);
        id
    }

    fn synthetic(&mut self, alts: Vec<Alt>) -> Result<usize, String> {
        self.count(&alts)?;
        self.rules.push(alts);
        Ok(self.rules.len() - 1)
    }

    fn count(&mut self, alts: &[Alt]) -> Result<(), String> {
        self.elements += alts.iter().map(|a| a.len() + 1).sum::<usize>();
        if self.elements > MAX_ELEMENTS {
            return Err(too_many_elements());
        }
        Ok(())
    }
}

/// The first cost `gbnf` breaks, as a sentence; Ok when none. A grammar
/// llama.cpp's parser would refuse for its syntax is left to it (Ok here
/// unless a cost is broken first).
pub fn check(gbnf: &str) -> Result<(), String> {
    let Some(g) = parse(gbnf)? else {
        return Ok(());
    };
    let Some(&root) = g.names.get("root") else {
        return Ok(());
    };
    walk_cost(&g.rules)?;
    fanout_cost(&g.rules, root)?;
    ambiguity_cost(&g)
}

/// Parses as llama.cpp's `llama_grammar_parser` does; None on a syntax it
/// would refuse.
fn parse(src: &str) -> Result<Option<Grammar>, String> {
    let mut g = Grammar {
        rules: Vec::new(),
        names: HashMap::new(),
        elements: 0,
        chains: HashMap::new(),
    };
    let b = src.as_bytes();
    let mut p = Parser { b, i: 0, depth: 0 };
    p.space(true);
    while p.i < b.len() {
        let Some(name) = p.name() else {
            return Ok(None);
        };
        p.space(false);
        if !b[p.i..].starts_with(b"::=") {
            return Ok(None);
        }
        p.i += 3;
        p.space(true);
        let Some(alts) = p.alternates(&mut g, false)? else {
            return Ok(None);
        };
        g.count(&alts)?;
        let id = g.id(&name);
        g.rules[id] = alts;
        p.space(true);
    }
    Ok(Some(g))
}

struct Parser<'a> {
    b: &'a [u8],
    i: usize,
    depth: usize,
}

fn too_many_elements() -> String {
    format!(
        "the grammar has more than {MAX_ELEMENTS} elements once its repetitions are written \
         out, the limit"
    )
}

fn left_recursive() -> String {
    "the grammar is left-recursive: a rule can start with itself (a $ref that refers back to \
     itself before any text)"
        .to_owned()
}

fn too_deep() -> String {
    format!("the grammar nests rules more than {MAX_NESTING} deep, the limit")
}

impl Parser<'_> {
    fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    /// Blanks and comments; newlines too where `newline_ok`.
    fn space(&mut self, newline_ok: bool) {
        while let Some(c) = self.peek() {
            match c {
                b' ' | b'\t' => self.i += 1,
                b'#' => {
                    while self.peek().is_some_and(|c| c != b'\n' && c != b'\r') {
                        self.i += 1;
                    }
                }
                b'\r' | b'\n' if newline_ok => self.i += 1,
                _ => return,
            }
        }
    }

    fn name(&mut self) -> Option<String> {
        let start = self.i;
        while self
            .peek()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_')
        {
            self.i += 1;
        }
        (self.i > start).then(|| String::from_utf8_lossy(&self.b[start..self.i]).into_owned())
    }

    fn number(&mut self) -> Option<u64> {
        let start = self.i;
        while self.peek().is_some_and(|c| c.is_ascii_digit()) {
            self.i += 1;
        }
        std::str::from_utf8(&self.b[start..self.i])
            .ok()?
            .parse()
            .ok()
    }

    /// Skips one character of a literal or class (an escape whole); the
    /// characters it stands for.
    fn char(&mut self) -> Option<()> {
        match self.peek()? {
            b'\\' => {
                self.i += 1;
                let n = match self.peek()? {
                    b'x' => 2,
                    b'u' => 4,
                    b'U' => 8,
                    _ => 0,
                };
                self.i += 1 + n;
            }
            c => {
                // A UTF-8 sequence is one character.
                let len = match c {
                    0xF0..=0xFF => 4,
                    0xE0..=0xEF => 3,
                    0xC0..=0xDF => 2,
                    _ => 1,
                };
                self.i += len;
            }
        }
        (self.i <= self.b.len()).then_some(())
    }

    fn alternates(&mut self, g: &mut Grammar, nested: bool) -> Result<Option<Vec<Alt>>, String> {
        let mut alts = Vec::new();
        loop {
            let Some(seq) = self.sequence(g, nested)? else {
                return Ok(None);
            };
            alts.push(seq);
            if self.peek() == Some(b'|') {
                self.i += 1;
                self.space(true);
            } else {
                return Ok(Some(alts));
            }
        }
    }

    fn sequence(&mut self, g: &mut Grammar, nested: bool) -> Result<Option<Alt>, String> {
        let mut seq: Alt = Vec::new();
        // Where the last item starts: a repetition applies to it.
        let mut last = seq.len();
        while let Some(c) = self.peek() {
            match c {
                b'"' => {
                    self.i += 1;
                    last = seq.len();
                    while self.peek() != Some(b'"') {
                        if self.char().is_none() {
                            return Ok(None);
                        }
                        seq.push(Sym::Term);
                    }
                    self.i += 1;
                }
                b'[' => {
                    self.i += 1;
                    last = seq.len();
                    while self.peek() != Some(b']') {
                        if self.char().is_none() {
                            return Ok(None);
                        }
                    }
                    self.i += 1;
                    seq.push(Sym::Term);
                }
                b'.' => {
                    self.i += 1;
                    last = seq.len();
                    seq.push(Sym::Term);
                }
                b'<' | b'!' => {
                    // A token (`<[id]>`, `<|name|>`) or a token it is not.
                    if c == b'!' {
                        self.i += 1;
                    }
                    let Some(end) = self.b[self.i..].iter().position(|&c| c == b'>') else {
                        return Ok(None);
                    };
                    self.i += end + 1;
                    last = seq.len();
                    seq.push(Sym::Term);
                }
                b'(' => {
                    self.i += 1;
                    self.space(true);
                    self.depth += 1;
                    if self.depth > MAX_NESTING {
                        return Err(too_deep());
                    }
                    let alts = self.alternates(g, true)?;
                    self.depth -= 1;
                    let Some(alts) = alts else {
                        return Ok(None);
                    };
                    if self.peek() != Some(b')') {
                        return Ok(None);
                    }
                    self.i += 1;
                    last = seq.len();
                    let id = g.synthetic(alts)?;
                    seq.push(Sym::Ref(id));
                }
                b'*' | b'+' | b'?' => {
                    self.i += 1;
                    let (min, max) = match c {
                        b'*' => (0, None),
                        b'+' => (1, None),
                        _ => (0, Some(1)),
                    };
                    repeat(g, &mut seq, last, min, max)?;
                }
                b'{' => {
                    self.i += 1;
                    self.space(false);
                    let Some(min) = self.number() else {
                        return Ok(None);
                    };
                    self.space(false);
                    let max = match self.peek() {
                        Some(b',') => {
                            self.i += 1;
                            self.space(false);
                            if self.peek() == Some(b'}') {
                                None
                            } else {
                                let Some(max) = self.number() else {
                                    return Ok(None);
                                };
                                Some(max)
                            }
                        }
                        _ => Some(min),
                    };
                    self.space(false);
                    if self.peek() != Some(b'}') {
                        return Ok(None);
                    }
                    self.i += 1;
                    if max.is_some_and(|max| max < min) {
                        return Err(format!(
                            "the grammar repeats an item {{{min},{}}}: at least more times than \
                             at most",
                            max.unwrap_or(0)
                        ));
                    }
                    repeat(g, &mut seq, last, min, max)?;
                }
                c if c.is_ascii_alphanumeric() || c == b'-' || c == b'_' => {
                    let Some(name) = self.name() else {
                        return Ok(None);
                    };
                    // A name followed by `::=` starts the next rule.
                    let save = self.i;
                    self.space(false);
                    if self.b[self.i..].starts_with(b"::=") {
                        self.i = save - name.len();
                        return Ok(Some(seq));
                    }
                    self.i = save;
                    last = seq.len();
                    let id = g.id(&name);
                    seq.push(Sym::Ref(id));
                }
                b'\r' | b'\n' if !nested => return Ok(Some(seq)),
                _ => return Ok(Some(seq)),
            }
            self.space(nested);
        }
        Ok(Some(seq))
    }
}

/// `S{min,max}` on the item from `last` on, rewritten as llama.cpp does:
/// S repeated `min` times, then `max - min` nested optional rules (one
/// recursive rule when there is no max).
fn repeat(
    g: &mut Grammar,
    seq: &mut Alt,
    last: usize,
    min: u64,
    max: Option<u64>,
) -> Result<(), String> {
    if last >= seq.len() {
        // llama.cpp refuses a repetition of nothing.
        return Ok(());
    }
    let item: Alt = seq[last..].to_vec();
    let copies = usize::try_from(min).unwrap_or(usize::MAX);
    if copies.saturating_mul(item.len()) > MAX_ELEMENTS {
        return Err(too_many_elements());
    }
    if min == 0 {
        seq.truncate(last);
    } else {
        for _ in 1..copies {
            seq.extend_from_slice(&item);
        }
    }
    g.elements += item.len() * copies.saturating_sub(1);
    let optional = match max {
        None => 1,
        Some(max) => max - min,
    };
    if optional == 0 {
        return Ok(());
    }
    if optional.saturating_mul(item.len() as u64 + 2) > MAX_ELEMENTS as u64 {
        return Err(too_many_elements());
    }
    let mut prev: Option<usize> = None;
    for _ in 0..optional {
        let id = g.rules.len();
        let mut alt = item.clone();
        match max {
            None => alt.push(Sym::Ref(id)),
            Some(_) => alt.extend(prev.map(Sym::Ref)),
        }
        let rule = g.synthetic(vec![alt, Vec::new()])?;
        prev = Some(rule);
    }
    if let Some(top) = prev {
        g.chains.insert(top, (item, optional));
    }
    seq.extend(prev.map(Sym::Ref));
    Ok(())
}

/// How many ways the grammar can stand at once after a character because
/// a repetition's item can match nothing: each copy may hold the next
/// character, so every (copy, place within it) is live, and nested ones
/// multiply. Per rule (memoised; a repetition read from its item, not its
/// nested optional rules): whether it can match nothing, how many places it
/// has, and that count of ways.
fn ambiguity_cost(g: &Grammar) -> Result<(), String> {
    #[derive(Clone, Copy)]
    struct Of {
        empty: bool,
        places: u64,
        ways: u64,
    }
    const CAP: u64 = 1 << 40;
    struct Eval<'a> {
        g: &'a Grammar,
        memo: Vec<Option<Of>>,
        in_progress: Vec<bool>,
    }
    impl Eval<'_> {
        fn seq(&mut self, alt: &[Sym], depth: usize) -> Result<Of, String> {
            let mut of = Of {
                empty: true,
                places: 0,
                ways: 1,
            };
            for sym in alt {
                let s = match *sym {
                    Sym::Term => Of {
                        empty: false,
                        places: 1,
                        ways: 1,
                    },
                    Sym::Ref(j) => self.rule(j, depth + 1)?,
                };
                of.empty &= s.empty;
                of.places = of.places.saturating_add(s.places).min(CAP);
                of.ways = of.ways.saturating_mul(s.ways).min(CAP);
            }
            Ok(of)
        }

        fn rule(&mut self, r: usize, depth: usize) -> Result<Of, String> {
            if let Some(of) = self.memo[r] {
                return Ok(of);
            }
            if self.in_progress[r] {
                // A recursive rule (a value holding values): counted once.
                return Ok(Of {
                    empty: false,
                    places: 1,
                    ways: 1,
                });
            }
            if depth >= MAX_NESTING {
                return Err(too_deep());
            }
            self.in_progress[r] = true;
            let g = self.g;
            let of = if let Some((item, copies)) = g.chains.get(&r) {
                let i = self.seq(item, depth)?;
                let own = if i.empty {
                    copies.saturating_mul(i.places.max(1))
                } else {
                    1
                };
                Of {
                    empty: true,
                    places: copies.saturating_mul(i.places).min(CAP),
                    ways: own.saturating_mul(i.ways).min(CAP),
                }
            } else {
                let mut of = Of {
                    empty: false,
                    places: 0,
                    ways: 1,
                };
                for alt in &g.rules[r] {
                    let a = self.seq(alt, depth)?;
                    of.empty |= a.empty;
                    of.places = of.places.saturating_add(a.places).min(CAP);
                    of.ways = of.ways.max(a.ways);
                }
                of
            };
            self.in_progress[r] = false;
            self.memo[r] = Some(of);
            Ok(of)
        }
    }
    let mut e = Eval {
        g,
        memo: vec![None; g.rules.len()],
        in_progress: vec![false; g.rules.len()],
    };
    for r in 0..g.rules.len() {
        let of = e.rule(r, 0)?;
        if of.ways > MAX_AMBIGUITY {
            return Err(format!(
                "the grammar repeats an item that can match nothing, {} ways at once after a \
                 character (in a pattern, a repetition of something optional, such as \
                 ([a-z]{{0,30}}){{0,30}}), over the limit of {MAX_AMBIGUITY}",
                of.ways
            ));
        }
    }
    Ok(())
}

/// llama.cpp's left-recursion check (`llama_grammar_detect_left_recursion`,
/// run from every rule, without a memo), counted step by step; a left
/// recursion, which llama.cpp refuses, is refused here.
fn walk_cost(rules: &[Vec<Alt>]) -> Result<(), String> {
    struct Walk<'a> {
        rules: &'a [Vec<Alt>],
        in_progress: Vec<bool>,
        may_be_empty: Vec<bool>,
        steps: u64,
        depth: usize,
        too_deep: bool,
    }
    impl Walk<'_> {
        /// Some(true): left recursion (llama.cpp refuses the grammar);
        /// None: over the cap.
        fn visit(&mut self, r: usize) -> Option<bool> {
            self.steps += 1;
            if self.steps > MAX_WALK {
                return None;
            }
            if self.in_progress[r] {
                return Some(true);
            }
            if self.depth >= MAX_NESTING {
                self.too_deep = true;
                return None;
            }
            self.depth += 1;
            self.in_progress[r] = true;
            let rules = self.rules;
            if rules[r].iter().any(Vec::is_empty) {
                self.may_be_empty[r] = true;
            }
            for alt in &rules[r] {
                for sym in alt {
                    match *sym {
                        Sym::Ref(j) if j < rules.len() => {
                            if self.visit(j)? {
                                return Some(true);
                            }
                            if !self.may_be_empty[j] {
                                break;
                            }
                        }
                        _ => break,
                    }
                }
            }
            self.in_progress[r] = false;
            self.depth -= 1;
            Some(false)
        }
    }
    let mut w = Walk {
        rules,
        in_progress: vec![false; rules.len()],
        may_be_empty: vec![false; rules.len()],
        steps: 0,
        depth: 0,
        too_deep: false,
    };
    for r in 0..rules.len() {
        match w.visit(r) {
            // llama.cpp stops at the first left recursion and refuses the
            // grammar; said here in words.
            Some(true) => return Err(left_recursive()),
            Some(false) => {}
            None if w.too_deep => return Err(too_deep()),
            None => {
                return Err(format!(
                    "the grammar's rules reach each other along more than {MAX_WALK} paths \
                     (alternatives that refer to the same definitions, level after level), \
                     the limit"
                ))
            }
        }
    }
    Ok(())
}

/// How many parse stacks llama.cpp's `llama_grammar_advance_stack` can
/// make at once, bounded from above: from each rule, the items it can
/// start with (through rules that can match nothing, to the items after
/// them), and then, at each place in an alternative after a matched
/// character, what the rest of it can start with. Computed once a rule
/// (its first items, through rules that can match nothing, form no cycle:
/// such a cycle is a left recursion, refused).
fn fanout_cost(rules: &[Vec<Alt>], root: usize) -> Result<(), String> {
    let cap = MAX_STACKS as u64 + 1;
    let over = || {
        format!(
            "the grammar opens more than {MAX_STACKS} ways to go on at once (optional items one \
             after another, or alternatives of alternatives), the limit"
        )
    };
    // (can match nothing, stacks it starts) of each rule.
    let mut memo: Vec<Option<(bool, u64)>> = vec![None; rules.len()];
    let mut in_progress = vec![false; rules.len()];
    fn eval(
        rules: &[Vec<Alt>],
        r: usize,
        depth: usize,
        memo: &mut Vec<Option<(bool, u64)>>,
        in_progress: &mut Vec<bool>,
        cap: u64,
    ) -> Result<(bool, u64), String> {
        if let Some(v) = memo[r] {
            return Ok(v);
        }
        if in_progress[r] {
            return Err(left_recursive());
        }
        if depth >= MAX_NESTING {
            return Err(too_deep());
        }
        in_progress[r] = true;
        let (mut nullable, mut starts) = (false, 0u64);
        for alt in &rules[r] {
            let mut through = true;
            for sym in alt {
                match *sym {
                    Sym::Term => {
                        starts += 1;
                        through = false;
                    }
                    Sym::Ref(j) => {
                        let (empty, n) = eval(rules, j, depth + 1, memo, in_progress, cap)?;
                        starts = starts.saturating_add(n);
                        through = empty;
                    }
                }
                if !through {
                    break;
                }
            }
            if through {
                nullable = true;
                starts += 1;
            }
            starts = starts.min(cap);
        }
        in_progress[r] = false;
        memo[r] = Some((nullable, starts));
        Ok((nullable, starts))
    }
    for r in 0..rules.len() {
        eval(rules, r, 0, &mut memo, &mut in_progress, cap)?;
    }
    let of = |j: usize| memo[j].unwrap_or((false, cap));
    if of(root).1 > MAX_STACKS as u64 {
        return Err(over());
    }
    for alt in rules.iter().flatten() {
        // What the rest of `alt` from each place can start, right to left.
        let mut rest = 1u64;
        for sym in alt.iter().rev() {
            rest = match *sym {
                Sym::Term => 1,
                Sym::Ref(j) => {
                    let (empty, n) = of(j);
                    n.saturating_add(if empty { rest } else { 0 }).min(cap)
                }
            };
            if rest > MAX_STACKS as u64 {
                return Err(over());
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `d0 ::= d1 | d1`, ... `dn ::= string`: the shape llama.cpp's
    /// converter gives `anyOf` chains of one `$ref` twice.
    fn chain(n: usize) -> String {
        let mut g = String::from("root ::= d0\n");
        for i in 0..n {
            g += &format!(
                "d{i} ::= d{i}-0 | d{i}-1\nd{i}-0 ::= d{j}\nd{i}-1 ::= d{j}\n",
                j = i + 1
            );
        }
        g += &format!("d{n} ::= \"\\\"\" [a-z]* \"\\\"\"\n");
        g
    }

    #[test]
    fn ordinary_grammars_pass() {
        let json = r#"root ::= object
object ::= "{" space ( string ":" space value ("," space string ":" space value)* )? "}" space
value ::= object | array | string | number | ("true" | "false" | "null") space
array ::= "[" space ( value ("," space value)* )? "]" space
string ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" (["\\bfnrt] | "u" [0-9a-fA-F]{4}) )* "\"" space
number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? space
# a comment
space ::= | " " | "\n"{1,2} [ \t]{0,20}
"#;
        assert_eq!(check(json), Ok(()));
        assert_eq!(check(&chain(10)), Ok(()));
        // A string of at most 1000 characters (maxLength: 1000).
        assert_eq!(check("root ::= \"\\\"\" [a-z]{0,1000} \"\\\"\"\n"), Ok(()));
    }

    #[test]
    fn a_repetition_at_least_more_than_at_most_is_refused() {
        let e = check("root ::= \"\\\"\" char{2,1} \"\\\"\"\nchar ::= [a-z]\n").unwrap_err();
        assert!(e.contains("{2,1}"), "{e}");
        assert_eq!(check("root ::= [a]{1,1}\n"), Ok(()));
        assert_eq!(check("root ::= [a]{0,0} [b]\n"), Ok(()));
    }

    #[test]
    fn chains_of_shared_alternatives_are_refused_past_the_walk() {
        // The walk doubles with each level: 2^17 paths pass, 2^20 do not.
        assert_eq!(check(&chain(14)), Ok(()));
        let e = check(&chain(20)).unwrap_err();
        assert!(e.contains("paths"), "{e}");
    }

    #[test]
    fn thousands_of_optional_items_in_a_row_are_refused() {
        let e = check(&format!("root ::= {} [b]\n", "(\"a\"?){1000} ".repeat(40))).unwrap_err();
        assert!(e.contains("ways to go on"), "{e}");
        // The converter's form of `"pattern": "^(a?){1000}...$"`: after the
        // opening quote, not at the start.
        let e = check(&format!(
            "root ::= \"\\\"\" ({}) \"\\\"\"\nroot-1 ::= (\"a\"?)\n",
            "root-1{1000,1000} ".repeat(40)
        ))
        .unwrap_err();
        assert!(e.contains("ways to go on"), "{e}");
        assert_eq!(
            check(&format!("root ::= {} [b]\n", "(\"a\"?){100} ")),
            Ok(())
        );
    }

    #[test]
    fn repetitions_of_what_can_match_nothing_are_refused_past_the_ways() {
        // The converter's form of `^([a-z ]{0,30}){0,30}$` and friends.
        let g = |body: &str| format!("root ::= \"\\\"\" ({body}) \"\\\"\"\n");
        for refused in [
            "([a-z ]{0,30}){0,30}",
            "(([a-z ]{0,10}){0,10}){0,10}",
            "([a-z ]* \",\"?){0,100}",
        ] {
            let e = check(&g(refused)).unwrap_err();
            assert!(e.contains("can match nothing"), "{refused}: {e}");
        }
        for ok in [
            "([a-z ]{0,10}){0,10}",
            "[a-z ]{0,1000} [0-9]{0,1000}",
            "(\",\" [a-z]+){0,1000}",
        ] {
            assert_eq!(check(&g(ok)), Ok(()), "{ok}");
        }
    }

    #[test]
    fn written_out_repetitions_are_capped() {
        assert_eq!(
            check(&format!("root ::= {}\n", "[a]{0,1000} ".repeat(250))),
            Ok(())
        );
        let e = check(&format!("root ::= {}\n", "[a]{1000} ".repeat(2500))).unwrap_err();
        assert!(e.contains("elements"), "{e}");
        // A repeated group is one rule referred to: a million matches, few
        // elements.
        assert_eq!(check("root ::= ((([a]){1000}){1000})\n"), Ok(()));
    }

    #[test]
    fn deep_nesting_is_refused_not_recursed_into() {
        let e = check(&format!(
            "root ::= {}\"a\"{}\n",
            "(".repeat(5000),
            ")".repeat(5000)
        ))
        .unwrap_err();
        assert!(e.contains("deep"), "{e}");
        // Rules whose leftmost item is the next rule, 5000 deep.
        let mut g = String::from("root ::= r0\n");
        for i in 0..5000 {
            g += &format!("r{i} ::= r{} \"a\"\n", i + 1);
        }
        let e = check(&g).unwrap_err();
        assert!(e.contains("deep"), "{e}");
    }

    #[test]
    fn left_recursion_is_refused_and_bad_syntax_left_to_llama_cpp() {
        let e = check("root ::= root \"a\" | \"b\"\n").unwrap_err();
        assert!(e.contains("left-recursive"), "{e}");
        let e = check("root ::= a\na ::= a\n").unwrap_err();
        assert!(e.contains("left-recursive"), "{e}");
        assert_eq!(check("root ::= \"unterminated\n"), Ok(()));
        assert_eq!(check("root ::= (\"a\"\n"), Ok(()));
        assert_eq!(check(""), Ok(()));
    }
}
