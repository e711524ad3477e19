//! Request paths as a permissive server routes them, for [`super::Config::path_kind`].

/// See [`Config::path_kind`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathKind {
    Guarded,
    Internal,
    DisguisedGuarded,
    Other,
}

/// `path` percent-decoded, lower-cased, with repeated slashes merged, `.` and `..` segments
/// resolved and no trailing slash (but the root's).
pub(super) fn normalize_path(path: &str) -> String {
    let bytes = path.as_bytes();
    let mut decoded = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while let Some(&c) = bytes.get(i) {
        let hex = |j: usize| bytes.get(j).and_then(|h| (*h as char).to_digit(16));
        match (c, hex(i + 1), hex(i + 2)) {
            (b'%', Some(h), Some(l)) => {
                decoded.push(u8::try_from(h * 16 + l).unwrap_or(b'%'));
                i += 3;
            }
            _ => {
                decoded.push(c);
                i += 1;
            }
        }
    }
    let decoded = String::from_utf8_lossy(&decoded).to_ascii_lowercase();
    let mut segments: Vec<&str> = Vec::new();
    for seg in decoded.split('/') {
        match seg {
            "" | "." => {}
            ".." => {
                segments.pop();
            }
            s => segments.push(s),
        }
    }
    format!("/{}", segments.join("/"))
}

/// Does normalized `path` match normalized `template`, segment by segment, `{id}` in a segment
/// standing for any non-empty text?
pub(super) fn template_matches(template: &str, path: &str) -> bool {
    let (t, p): (Vec<&str>, Vec<&str>) = (template.split('/').collect(), path.split('/').collect());
    template != "/"
        && t.len() == p.len()
        && t.iter().zip(&p).all(|(t, p)| match t.split_once("{id}") {
            None => t == p,
            Some((before, after)) => {
                p.len() > before.len() + after.len() && p.starts_with(before) && p.ends_with(after)
            }
        })
}
