//! The session API's small codes as types: roles, channels, finish reasons,
//! QoS classes, tool outcomes, fill-in-the-middle modes and ledger statuses.
//!
//! Each serialises exactly as the integer (or string) the spec writes, so
//! the bytes on the wire and in wal.log are those of the plain `u8` they
//! replace (tests/tests/spec_json.rs's goldens hold them to it).
//!
//! Where they appear: records and replies, which only the daemon writes,
//! carry the types. Requests carry the plain integers the client sent, and
//! the code that handles a request turns them into the type with
//! `TryFrom<u8>`, so a bad value gets that request's own clear
//! `Err { message }` rather than a decode error (postcard drops a decode
//! error's text).

use serde::{Deserialize, Serialize};

/// A code the spec does not define.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("unknown {what} {value}: {expected}")]
pub struct UnknownCode {
    /// What the code names ("role", "channel", ...).
    pub what: &'static str,
    pub value: u8,
    /// The codes there are, as the spec lists them.
    pub expected: &'static str,
}

/// Declares a code enum that serialises as its `u8`, with `TryFrom<u8>`,
/// `From<Self> for u8` and `name()`.
macro_rules! u8_code {
    (
        $(#[$meta:meta])*
        $name:ident, $what:literal, $expected:literal {
            $($(#[$vmeta:meta])* $variant:ident = $value:literal => $label:literal,)+
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(into = "u8", try_from = "u8")]
        pub enum $name {
            $($(#[$vmeta])* $variant = $value,)+
        }

        impl $name {
            /// Every code, in order.
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            /// The code's name, as the spec writes it.
            pub fn name(self) -> &'static str {
                match self {
                    $($name::$variant => $label,)+
                }
            }
        }

        impl From<$name> for u8 {
            fn from(code: $name) -> u8 {
                code as u8
            }
        }

        impl TryFrom<u8> for $name {
            type Error = UnknownCode;
            fn try_from(value: u8) -> Result<$name, UnknownCode> {
                match value {
                    $($value => Ok($name::$variant),)+
                    _ => Err(UnknownCode { what: $what, value, expected: $expected }),
                }
            }
        }
    };
}

u8_code! {
    /// Who a message is from.
    Role, "role", "roles are 0 system, 1 user, 2 assistant, 3 tool" {
        System = 0 => "system",
        User = 1 => "user",
        Assistant = 2 => "assistant",
        Tool = 3 => "tool",
    }
}

u8_code! {
    /// Which channel generated text is on.
    Channel, "channel", "channels are 0 text, 1 reasoning, 2 tool call" {
        Text = 0 => "text",
        Reasoning = 1 => "reasoning",
        ToolCall = 2 => "tool call",
    }
}

impl Default for Channel {
    /// A chunk of output starts on the text channel.
    fn default() -> Channel {
        Channel::Text
    }
}

u8_code! {
    /// Why a generation ended; `Open` on a `Generated` event whose turn is
    /// still open.
    Finish, "finish", "finish is 0 open, 1 end of turn, 2 max_tokens, 3 grammar, 4 cancelled, 5 error" {
        Open = 0 => "open",
        EndOfTurn = 1 => "end of turn",
        MaxTokens = 2 => "max_tokens",
        /// A grammar-forced tool call completed.
        Grammar = 3 => "grammar",
        Cancelled = 4 => "cancelled",
        Error = 5 => "error",
    }
}

u8_code! {
    /// A scheduling class: 0 is admitted and stepped first, 3 is the
    /// background class (slowed by `SetBackgroundRate`).
    QosClass, "QoS class", "classes are 0 to 3" {
        First = 0 => "0",
        Second = 1 => "1",
        Third = 2 => "2",
        Background = 3 => "3",
    }
}

impl QosClass {
    /// The number of classes.
    pub const COUNT: usize = 4;

    /// The class's index, 0 (first) to 3 (background).
    pub fn index(self) -> usize {
        self as usize
    }
}

u8_code! {
    /// How a tool call ended without a result (`AppendToolOutcome`).
    ToolOutcome, "outcome", "outcomes are 1 failed, 2 cancelled" {
        Failed = 1 => "failed",
        Cancelled = 2 => "cancelled",
    }
}

u8_code! {
    /// The fill-in-the-middle layout of a `Complete`.
    FimMode, "mode", "modes are 0 PSM, 1 SPM" {
        /// prefix, suffix, middle.
        Psm = 0 => "PSM",
        /// suffix, prefix, middle.
        Spm = 1 => "SPM",
    }
}

/// Where a tool call of the `Ledger` stands; serialised as the string it
/// was before it had a type (a string in JSON and in postcard alike).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(into = "String", try_from = "String")]
pub enum LedgerStatus {
    Open,
    Answered,
    Failed,
    Cancelled,
    CancelRequested,
}

impl LedgerStatus {
    pub const ALL: &'static [LedgerStatus] = &[
        LedgerStatus::Open,
        LedgerStatus::Answered,
        LedgerStatus::Failed,
        LedgerStatus::Cancelled,
        LedgerStatus::CancelRequested,
    ];

    /// The status as the spec writes it.
    pub fn name(self) -> &'static str {
        match self {
            LedgerStatus::Open => "open",
            LedgerStatus::Answered => "answered",
            LedgerStatus::Failed => "failed",
            LedgerStatus::Cancelled => "cancelled",
            LedgerStatus::CancelRequested => "cancel requested",
        }
    }
}

impl std::fmt::Display for LedgerStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl From<LedgerStatus> for String {
    fn from(status: LedgerStatus) -> String {
        status.name().to_string()
    }
}

/// A ledger status the spec does not define.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown ledger status {0:?}")]
pub struct UnknownStatus(pub String);

impl TryFrom<String> for LedgerStatus {
    type Error = UnknownStatus;
    fn try_from(s: String) -> Result<LedgerStatus, UnknownStatus> {
        LedgerStatus::ALL
            .iter()
            .copied()
            .find(|status| status.name() == s)
            .ok_or(UnknownStatus(s))
    }
}

impl From<ToolOutcome> for LedgerStatus {
    fn from(outcome: ToolOutcome) -> LedgerStatus {
        match outcome {
            ToolOutcome::Failed => LedgerStatus::Failed,
            ToolOutcome::Cancelled => LedgerStatus::Cancelled,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_their_integers_on_the_wire() {
        for &role in Role::ALL {
            let n = u8::from(role);
            assert_eq!(
                postcard::to_stdvec(&role).unwrap(),
                postcard::to_stdvec(&n).unwrap()
            );
            assert_eq!(serde_json::to_string(&role).unwrap(), n.to_string());
            assert_eq!(Role::try_from(n), Ok(role));
        }
        for &finish in Finish::ALL {
            let n = u8::from(finish);
            assert_eq!(postcard::to_stdvec(&finish).unwrap(), vec![n]);
            let back: Finish = serde_json::from_str(&n.to_string()).unwrap();
            assert_eq!(back, finish);
        }
        assert_eq!(u8::from(Channel::ToolCall), 2);
        assert_eq!(u8::from(QosClass::Background), 3);
        assert_eq!(u8::from(ToolOutcome::Cancelled), 2);
        assert_eq!(u8::from(FimMode::Spm), 1);
    }

    #[test]
    fn unknown_codes_are_refused_with_the_list() {
        let e = Role::try_from(7).unwrap_err();
        assert_eq!(
            e.to_string(),
            "unknown role 7: roles are 0 system, 1 user, 2 assistant, 3 tool"
        );
        assert!(ToolOutcome::try_from(0).is_err());
        assert!(QosClass::try_from(4).is_err());
        assert!(serde_json::from_str::<Channel>("3").is_err());
        assert!(postcard::from_bytes::<Finish>(&[6]).is_err());
    }

    #[test]
    fn ledger_status_is_the_spec_string() {
        assert_eq!(
            serde_json::to_string(&LedgerStatus::CancelRequested).unwrap(),
            "\"cancel requested\""
        );
        for &s in LedgerStatus::ALL {
            assert_eq!(
                serde_json::to_string(&s).unwrap(),
                format!("\"{}\"", s.name())
            );
            let name = s.name().to_string();
            assert_eq!(
                postcard::to_stdvec(&s).unwrap(),
                postcard::to_stdvec(&name).unwrap()
            );
            let bytes = postcard::to_stdvec(&name).unwrap();
            assert_eq!(postcard::from_bytes::<LedgerStatus>(&bytes).unwrap(), s);
        }
    }
}
