//! Pricing a prompt counted by an approximate tokenizer (`tokenizer.multiplier` > 1, or
//! `"from_backend"` before its descriptor): the count times the multiplier, padded for the runs
//! the approximation merges and the model may not, and never below the pieces the model's
//! pre-tokenizer cuts (`tokenizer.pad_runs`). One pass over each text.

/// A text count by an approximate tokenizer, padded toward the model's (`multiplier` > 1 says
/// the configured tokenizer is not the model's own): the count times `multiplier`, plus, with
/// `runs` (`tokenizer.pad_runs`), [`approximation_excess`] of each text counted (a chat's
/// roles, contents and other fields), and never below the [`pretokens`] of those texts (what
/// SmolLM2's pre-tokenizer cuts them into, each a token at least).
pub fn padded_count<'a>(
    count: u64,
    multiplier: f64,
    runs: bool,
    texts: impl IntoIterator<Item = &'a str>,
) -> u64 {
    if multiplier <= 1.0 {
        return count;
    }
    let scaled = (count as f64 * multiplier).ceil() as u64;
    if !runs {
        return scaled;
    }
    // One pass over each text gives both its pad and its pieces.
    let (padded, floor) = texts
        .into_iter()
        .map(pad)
        .fold((scaled, 0u64), |(n, floor), p| {
            (n.saturating_add(p.excess), floor.saturating_add(p.pieces))
        });
    padded.max(floor)
}

/// A maximal run [`approximation_excess`] prices: numeric characters, or one other character
/// repeated.
#[derive(Clone, Copy, PartialEq)]
enum Run {
    Digits,
    Same(char),
}

impl Run {
    /// What a run of `n` costs the model past what the approximation surely counted.
    fn excess(self, n: u64) -> u64 {
        let priced = match self {
            // Chunks of three were counted.
            Run::Digits => return n - n.div_ceil(3),
            Run::Same(' ') => n.div_ceil(16),
            Run::Same(c) if c.is_ascii() => n.div_ceil(4),
            Run::Same(c) if n >= 3 => n.saturating_mul(c.len_utf8() as u64),
            Run::Same(_) => 1,
        };
        // At least one token was counted.
        priced.saturating_sub(1)
    }
}

/// What a model's tokenizer may count in `text` past an approximation, where no multiplier of
/// a few covers the difference (measured with SmolLM2 against cl100k_base in docs/lab/2026-12-benchmarks-history.md,
/// "Runs the approximation merges, padded apart"): the approximation merges long runs the
/// model's vocabulary does not. One pass over the text, as the count made. Per maximal run:
/// - of `L` numeric characters (`\p{N}`): `L - ceil(L/3)`. Every built-in encoding but the
///   GPT-2 ones chunks digits by three (`\p{N}{1,3}`); SmolLM2's, Qwen2's and Llama 2's
///   tokenizers give each digit its own token.
/// - of one other character repeated `L` times: what it costs at the model's shortest likely
///   merges, less the one token the approximation gave it at least. A space `ceil(L/16)`
///   (tokenizers trained on code merge indentation), another ASCII character `ceil(L/4)` (runs
///   of newlines, dots or letters: SmolLM2 merges them by 4 to 31, cl100k_base by up to 128),
///   and a character outside ASCII repeated 3 times or more, its UTF-8 bytes (the most a
///   byte-level tokenizer makes of it: SmolLM2 gives a zero-width space two tokens; a pair,
///   as in Chinese 人人, costs nothing).
/// - of spaces, or of symbols, of more than one kind: half a token for each change of character
///   past the third (`mixed_excess`).
pub fn approximation_excess(text: &str) -> u64 {
    pad(text).excess
}

/// How many pieces SmolLM2's pre-tokenizer cuts `text` into before its BPE merges anything:
/// the model counts at least as many tokens (each piece is one token or more). Its pattern
/// (GPT-2's, with each digit its own piece; FACTS.md):
/// `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+`,
/// matched by hand in one pass. An approximation like cl100k_base merges one punctuation
/// character into the word after it (`/b`), where this pattern cuts them apart: a path `a/b/c/`
/// is a token a character to SmolLM2 and one per two to cl100k_base. Never above the pattern's
/// count: an alphabetic character outside ASCII, which may be a letter or a mark, joins the
/// piece beside it whichever it is. Patterns that join a symbol to the word after it (Qwen2's,
/// Llama 3's, cl100k_base's) cut fewer pieces: for such a model this floor prices a path up to
/// twice its count (`tokenizer.pad_runs: false` turns it off).
pub fn pretokens(text: &str) -> u64 {
    pad(text).pieces
}

/// What a run of spaces or symbols costs past its approximation when its character changes
/// `changes` times: SmolLM2 gives `\n ` and `\n\t` a token a pair, ` \t` and `-_` one a
/// character, where cl100k_base merges them by 4 to 16. A line break and its indentation, a
/// blank line that keeps its indentation, or `();`, change three times or less and cost nothing.
fn mixed_excess(changes: u64) -> u64 {
    changes.saturating_sub(3) / 2
}

/// A character's class in a GPT-2-style pre-tokenizer's pattern.
#[derive(Clone, Copy, PartialEq)]
enum Class {
    Letter,
    Number,
    Space,
    Other,
    /// Alphabetic outside ASCII: a letter (`\p{L}`), or a mark or symbol the pattern takes for
    /// `[^\s\p{L}\p{N}]` (a vowel sign, a circled letter); Rust's std does not tell them apart.
    /// It joins the letters or symbols beside it, whichever they are, so no piece is counted
    /// that the pattern would not cut.
    Alpha,
}

impl Class {
    fn of(c: char) -> Class {
        match c {
            '0'..='9' => Class::Number,
            'a'..='z' | 'A'..='Z' => Class::Letter,
            '\t'..='\r' | ' ' => Class::Space,
            _ if c.is_ascii() => Class::Other,
            // Letters (`\p{L}`) of the commonest scripts, without a lookup in Unicode's tables:
            // Latin-1's, Cyrillic's basic, kana, CJK ideographs, Hangul syllables.
            '\u{c0}'..='\u{d6}'
            | '\u{d8}'..='\u{f6}'
            | '\u{f8}'..='\u{ff}'
            | '\u{410}'..='\u{44f}'
            | '\u{3041}'..='\u{3096}'
            | '\u{30a1}'..='\u{30fa}'
            | '\u{3400}'..='\u{4dbf}'
            | '\u{4e00}'..='\u{9fff}'
            | '\u{ac00}'..='\u{d7a3}' => Class::Letter,
            _ if c.is_numeric() => Class::Number,
            _ if c.is_alphabetic() => Class::Alpha,
            _ if c.is_whitespace() => Class::Space,
            _ => Class::Other,
        }
    }
}

/// What one text adds to an approximate count: [`approximation_excess`] and [`pretokens`].
#[derive(Default)]
struct Pad {
    excess: u64,
    pieces: u64,
}

impl Pad {
    /// A run of `n` of one character (or of digits, `class` [`Class::Number`]) ended.
    fn run(&mut self, c: char, class: Option<Class>, n: u64) {
        if n > 1 {
            let run = match class {
                Some(Class::Number) => Run::Digits,
                _ => Run::Same(c),
            };
            self.excess = self.excess.saturating_add(run.excess(n));
        }
    }

    /// A letter run ended; `after_apostrophe`, if it followed an apostrophe that began a piece.
    fn letters(&mut self, after_apostrophe: Option<(char, char, u8)>) {
        if after_apostrophe.is_some_and(contraction) {
            self.pieces = self.pieces.saturating_sub(1);
        }
    }
}

/// A letter run right after an apostrophe that began a piece, its first two letters and how
/// many it has (up to 3): a contraction (`'s`, `'t`, `'re`, `'ve`, `'m`, `'ll`, `'d`) if it ends
/// exactly there, where the pattern cuts one piece of the apostrophe and those letters.
fn contraction((first, second, n): (char, char, u8)) -> bool {
    matches!(
        (first, second, n),
        ('s' | 't' | 'm' | 'd', _, 1) | ('r' | 'v', 'e', 2) | ('l', 'l', 2)
    )
}

/// [`approximation_excess`] and [`pretokens`] of `text`, in one pass over its characters, each
/// classed once; most of the work is done where the character or its class changes.
fn pad(text: &str) -> Pad {
    let mut pad = Pad::default();
    let (mut prev, mut prev_class) = ('\0', None);
    // The run of one character (or of digits) being priced, and its length.
    let mut run = 0u64;
    // How often the character changed in a row of spaces, or of symbols, and the class of the
    // previous character as [`Class::of`] gave it (a row of symbols ends at a letter outside
    // ASCII even where its piece goes on).
    let (mut changes, mut prev_raw) = (0u64, None);
    // The whitespace run before this character: its length and last character.
    let (mut spaces, mut last_space) = (0u64, ' ');
    // An apostrophe that began a piece just before; the letters (up to three) of a run that
    // followed one.
    let mut apostrophe = false;
    let mut after_apostrophe: Option<(char, char, u8)> = None;
    let bytes = text.as_bytes();
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        // The letters of an ASCII word after its first, each unlike the one before: all they
        // change is the run of one character (most of a text, so taken apart).
        if prev_class == Some(Class::Letter)
            && after_apostrophe.is_none()
            && b.is_ascii_alphabetic()
            && char::from(b) != prev
        {
            pad.run(prev, prev_class, run);
            run = 1;
            prev = char::from(b);
            i += 1;
            while let Some(&b) = bytes.get(i) {
                if !b.is_ascii_alphabetic() || char::from(b) == prev {
                    break;
                }
                prev = char::from(b);
                i += 1;
            }
            prev_raw = Some(Class::Letter);
            continue;
        }
        // More ASCII digits (each a piece), or the same space or symbol again: all they change
        // is a count.
        let same = |b: u8| char::from(b) == prev;
        let repeat = match prev_class {
            Some(Class::Number) if b.is_ascii_digit() => Some(Class::Number),
            Some(k @ (Class::Space | Class::Other)) if same(b) => Some(k),
            _ => None,
        };
        if let Some(k) = repeat {
            let start = i;
            while bytes.get(i).is_some_and(|&b| match k {
                Class::Number => b.is_ascii_digit(),
                _ => same(b),
            }) {
                i += 1;
            }
            let n = (i - start) as u64;
            run += n;
            match k {
                Class::Number => pad.pieces += n,
                Class::Space => spaces += n,
                _ => apostrophe = false,
            }
            if let Some(&last) = bytes.get(i - 1) {
                prev = char::from(last);
            }
            prev_raw = Some(k);
            continue;
        }
        let c = match b {
            0..=0x7f => char::from(b),
            _ => match text.get(i..).and_then(|t| t.chars().next()) {
                Some(c) => c,
                None => break,
            },
        };
        i += c.len_utf8();
        let raw = Class::of(c);
        let class = match (raw, prev_class) {
            // A contraction ends here, and the pattern's next piece begins at this character
            // (the piece counted for the contraction's letters is this one's).
            (Class::Alpha, Some(Class::Letter)) if after_apostrophe.is_some_and(contraction) => {
                after_apostrophe = None;
                prev_class = Some(Class::Alpha);
                Class::Alpha
            }
            (Class::Alpha, Some(k @ (Class::Letter | Class::Other | Class::Alpha))) => k,
            // A piece begun by such a character is of the class that follows it.
            (k @ (Class::Letter | Class::Other), Some(Class::Alpha)) => {
                prev_class = Some(k);
                k
            }
            (k, _) => k,
        };
        let same_class = prev_class == Some(class);
        if c == prev || (same_class && class == Class::Number) {
            run += 1;
        } else {
            pad.run(prev, prev_class, run);
            run = 1;
            if prev_raw != Some(raw) {
                pad.excess = pad.excess.saturating_add(mixed_excess(changes));
                changes = 0;
            } else if matches!(raw, Class::Space | Class::Other) {
                changes += 1;
            }
        }
        prev_raw = Some(raw);
        if same_class {
            match class {
                Class::Space => (spaces, last_space) = (spaces + 1, c),
                Class::Letter => {
                    if let Some((_, second, n)) = &mut after_apostrophe {
                        if *n == 1 {
                            *second = c;
                        }
                        *n = (*n + 1).min(3);
                    }
                }
                // Each digit is a piece.
                Class::Number => pad.pieces += 1,
                // The apostrophe began a run of symbols, not a contraction.
                Class::Other => apostrophe = false,
                Class::Alpha => {}
            }
            prev = c;
            continue;
        }
        // The class changed: close what the previous class began.
        let began_apostrophe = std::mem::take(&mut apostrophe);
        match prev_class {
            Some(Class::Space) => {
                pad.pieces += match class {
                    Class::Letter | Class::Other | Class::Alpha => {
                        u64::from(spaces > 1) + u64::from(last_space != ' ')
                    }
                    _ => 1,
                };
            }
            Some(Class::Letter) => pad.letters(after_apostrophe.take()),
            _ => {}
        }
        match class {
            Class::Space => (spaces, last_space) = (1, c),
            Class::Letter => {
                pad.pieces += 1;
                if began_apostrophe {
                    after_apostrophe = Some((c, ' ', 1));
                }
            }
            Class::Other => {
                pad.pieces += 1;
                // A space before it joined its piece: no contraction there.
                let joined = prev_class == Some(Class::Space) && last_space == ' ';
                apostrophe = c == '\'' && !joined;
            }
            Class::Number | Class::Alpha => pad.pieces += 1,
        }
        (prev, prev_class) = (c, Some(class));
    }
    pad.run(prev, prev_class, run);
    pad.excess = pad.excess.saturating_add(mixed_excess(changes));
    match prev_class {
        Some(Class::Space) => pad.pieces += 1,
        Some(Class::Letter) => pad.letters(after_apostrophe),
        _ => {}
    }
    pad
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenize::{Encoding, TokenCounter, TokenizerSpec};
    use proptest::prelude::*;

    /// The run pad of the texts of one request.
    fn excess(texts: &[&str]) -> u64 {
        texts.iter().map(|t| approximation_excess(t)).sum()
    }

    #[test]
    fn an_approximate_count_is_padded_by_its_multiplier_digits_and_runs() {
        let cl = TokenCounter::new(&TokenizerSpec::Builtin(Encoding::Cl100kBase)).unwrap();
        // cl100k_base chunks a run of digits by three: "123456789" is 3 tokens, each space 1.
        let numbers = vec!["123456789"; 1200].join(" ");
        let counted = cl.count_text(&numbers);
        assert_eq!(counted, 1200 * 3 + 1199);
        // A tokenizer that gives each digit its own token serves 9 a number (SmolLM2: 12,000
        // tokens for 12,000 such characters, BENCHMARKS.md); the multiplier alone (1.6) falls
        // far short of it, the digits' own pad does not.
        let served = 1200 * 9 + 1199;
        assert!(((counted as f64) * 1.6) < served as f64);
        let padded = padded_count(counted, 1.6, true, [numbers.as_str()]);
        assert_eq!(padded, (counted as f64 * 1.6).ceil() as u64 + 1200 * 6);
        assert!(padded >= served);
        // Text without digits is padded by the multiplier alone.
        let prose = "The quick brown fox jumps over the lazy dog.";
        let n = cl.count_text(prose);
        assert_eq!(
            padded_count(n, 1.5, true, [prose]),
            (n as f64 * 1.5).ceil() as u64
        );
        // Runs end at any other character; a run of one or two digits is at most one token
        // past its chunk; every numeric character counts (here Arabic-Indic digits); each text
        // of a chat adds its own.
        assert_eq!(excess(&["12a34 5"]), 2);
        assert_eq!(excess(&["\u{661}\u{662}\u{663}\u{664}"]), 2);
        assert_eq!(excess(&["1234", "", "12"]), 3);
        // A run of one repeated character, past what the approximation surely gave it (one
        // token): a space at 16 a token, another ASCII character at 4, a character outside
        // ASCII at its bytes. Runs of up to 4 (16 spaces), pairs outside ASCII and single
        // characters cost nothing.
        assert_eq!(excess(&["\n".repeat(2900).as_str()]), 725 - 1);
        assert_eq!(excess(&[" ".repeat(2900).as_str()]), 182 - 1);
        assert_eq!(excess(&["\u{200b}".repeat(900).as_str()]), 2700 - 1);
        assert_eq!(
            excess(&["a\n\n\n\nb                c  d\u{4eba}\u{4eba}"]),
            0
        );
        // Spaces or symbols of several kinds in a row: half a token each time the character
        // changes, past the third change. A line break with its indentation, a blank line
        // that keeps it and `();` cost nothing.
        assert_eq!(excess(&["\n ".repeat(1000).as_str()]), 998);
        assert_eq!(excess(&["-_".repeat(1000).as_str()]), 998);
        assert_eq!(excess(&["a\n    \n  b();\n"]), 0);
        assert_eq!(excess(&["x \t \t \ty"]), 1);
        // SmolLM2 counts 725 tokens for 2,900 newlines, cl100k_base 96: priced above the model.
        let newlines = "\n".repeat(2900);
        assert_eq!(cl.count_text(&newlines), 96);
        assert!(padded_count(96, 1.6, true, [newlines.as_str()]) >= 725);
        // A count the configuration calls exact (multiplier 1) is never padded.
        assert_eq!(
            padded_count(counted, 1.0, true, [numbers.as_str()]),
            counted
        );
        // Runs not padded (`tokenizer.pad_runs: false`): the multiplier alone.
        assert_eq!(
            padded_count(counted, 1.6, false, [numbers.as_str()]),
            (counted as f64 * 1.6).ceil() as u64
        );
    }

    /// SmolLM2's pre-tokenizer pattern (FACTS.md), which [`pretokens`] matches by hand.
    const SMOLLM2_PATTERN: &str =
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+";

    fn pattern_pieces(text: &str) -> u64 {
        // Compiled once: the property test matches it a thousand times (under wasmtime too).
        static PATTERN: std::sync::OnceLock<fancy_regex::Regex> = std::sync::OnceLock::new();
        let re = PATTERN.get_or_init(|| fancy_regex::Regex::new(SMOLLM2_PATTERN).unwrap());
        re.find_iter(text).filter(|m| m.is_ok()).count() as u64
    }

    #[test]
    fn pretokens_are_the_pieces_of_smollm2s_pattern_and_floor_an_approximate_count() {
        for (text, pieces) in [
            // A path: cl100k_base merges each slash into the letter after it, SmolLM2 does not.
            ("a/b/c/d/", 8),
            ("don't stop", 3),
            ("  hello", 2),
            ("\n\nhello", 3),
            ("x  \n  y", 3),
            (" 12", 3),
            ("", 0),
        ] {
            assert_eq!(pattern_pieces(text), pieces, "{text:?}");
            assert_eq!(pretokens(text), pieces, "{text:?}");
        }
        // Alphabetic characters that are no letters to the pattern (a vowel sign, a circled
        // letter, a symbol with its variation selector) join the piece beside them.
        let circled = "Ⓐ.".repeat(50);
        for text in [
            "(Ⓐ)",
            "🅿\u{fe0f}",
            "-\u{93e}",
            "x'Ⓐ",
            "'s\u{93e}\u{fe0f}",
            circled.as_str(),
        ] {
            assert!(pretokens(text) <= pattern_pieces(text), "{text:?}");
        }
        assert_eq!(pretokens(&circled), 1);
        // Contractions and apostrophes that are none.
        for text in ["'hello", "it's", "we'll've'd", "'r'l'", "'s's"] {
            assert_eq!(pretokens(text), pattern_pieces(text), "{text:?}");
        }
        // A path priced by cl100k_base at 1.6 falls short of SmolLM2's count (a token a
        // character, BENCHMARKS.md); its pieces floor the price.
        let cl = TokenCounter::new(&TokenizerSpec::Builtin(Encoding::Cl100kBase)).unwrap();
        let path = "a/b/c/d/".repeat(250);
        let counted = cl.count_text(&path);
        assert!(((counted as f64) * 1.6) < 2000.0, "{counted}");
        assert_eq!(padded_count(counted, 1.6, true, [path.as_str()]), 2000);
        // Prose in other scripts is priced by its multiplier alone: letters outside ASCII
        // between punctuation of their own script are no run of symbols.
        for prose in [
            "人人生而自由，在尊严和权利上一律平等。他们赋有理性和良心，并应以兄弟关系的精神相对待。",
            "Все люди рождаются свободными и равными в своем достоинстве и правах. «Они» — братья.",
            "Die Würde des Menschen ist unantastbar. Sie zu achten und zu schützen ist Pflicht.",
        ] {
            let prose = prose.repeat(20);
            assert_eq!(approximation_excess(&prose), 0, "{prose}");
            let n = cl.count_text(&prose);
            assert!(pretokens(&prose) < n, "{prose}");
            assert_eq!(padded_count(n, 1.6, true, [prose.as_str()]), (n as f64 * 1.6).ceil() as u64);
        }
        // Prose is priced by its multiplier, far above its pieces.
        let prose = "The quick brown fox jumps over the lazy dog.";
        assert_eq!(pretokens(prose), 10);
        let n = cl.count_text(prose);
        assert_eq!(
            padded_count(n, 1.5, true, [prose]),
            (n as f64 * 1.5).ceil() as u64
        );
        // The pieces of every text of a request add up; without the run pad, no floor.
        assert_eq!(padded_count(0, 1.1, true, ["a/b", "c/d"]), 6);
        assert_eq!(padded_count(0, 1.1, false, ["a/b", "c/d"]), 0);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// [`pretokens`] counts what the pattern matches, and never more: exactly on ASCII,
        /// the commonest scripts' letters, digits, spaces and symbols; at most as many with
        /// other alphabetic characters (letters, vowel signs, circled letters), which join the
        /// piece beside them.
        #[test]
        fn pretokens_match_smollm2s_pattern(
            t in proptest::collection::vec(proptest::sample::select(
                &['a', 'Z', 'é', 'ж', '中', 'ア', '한', '1', '\u{661}', ' ', ' ', '\n', '\t', '\u{a0}', '/', '.', '😀', '\u{200b}', '\u{301}', '\'', 's', 'r', 'e', 'l'][..]), 0..60),
            marks in proptest::collection::vec(proptest::sample::select(
                &['a', ' ', '\'', 's', 'l', 'é', '中', '\u{93e}', '\u{94d}', 'क', 'Ⓐ', '🅿', '\u{fe0f}', '.', '(', '\n', '1'][..]), 0..60),
        ) {
            let t: String = t.into_iter().collect();
            prop_assert_eq!(pretokens(&t), pattern_pieces(&t), "{:?}", t);
            let m: String = marks.into_iter().collect();
            prop_assert!(pretokens(&m) <= pattern_pieces(&m), "{:?}", m);
        }
    }
}
