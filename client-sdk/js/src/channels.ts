// Channel events on the client (PROTOCOL.md §12): ChannelTracker turns the DATA payloads of
// CHANNEL_EVENT_MSG_ID into ChannelUpdates, keeps each channel's last position (what the
// game hands its backend to recover after a new login, §12.4), and drops a publication it
// has already shown (same epoch, offset not above the last one): the downstream dedup by
// server message id, where the id is (channel, epoch, offset). Mirrors the Rust SDK's
// `client-sdk/src/channels.rs`.

import { type ChannelEvent, ChannelEventKind, ProtocolError, decodeChannelEvent } from "./codec.js";

/** Where a channel's stream stands (§12.1). */
export interface ChannelPosition {
  /** Identifies one incarnation of the channel's history (below 2^53). */
  epoch: number;
  /** Offset of the last publication counted (0n before the first one). */
  offset: bigint;
}

/** What a channel event says. */
export type ChannelUpdateKind = "publication" | "joined" | "left" | "historyLost";

/**
 * One channel event for the game.
 * - `publication`: `offset` is its own (0n for best-effort, never recovered); `body` the publisher's bytes.
 * - `joined`: the session became a member; live publications follow `epoch`/`offset`.
 * - `left`: the session is no longer a member; `offset` is the last one it was sent.
 * - `historyLost`: what was missed cannot be recovered: reload the state this channel
 *   carries from the game; live publications follow `epoch`/`offset`.
 *
 * `body` is empty for every kind but `publication`.
 */
export interface ChannelUpdate {
  kind: ChannelUpdateKind;
  channel: string;
  epoch: number;
  offset: bigint;
  body: Uint8Array;
}

const KIND_NAMES: Record<ChannelEventKind, ChannelUpdateKind> = {
  [ChannelEventKind.Publication]: "publication",
  [ChannelEventKind.Joined]: "joined",
  [ChannelEventKind.Left]: "left",
  [ChannelEventKind.HistoryLost]: "historyLost",
};

/**
 * Positions per channel and the duplicate filter (§12.3). Sans-IO: feed it every channel
 * event; `WaygateClient` does this for the DATA frames of `CHANNEL_EVENT_MSG_ID`.
 */
export class ChannelTracker {
  private readonly last = new Map<string, ChannelPosition>();
  private _duplicates = 0;
  private _undecodable = 0;

  /**
   * Takes one channel event; `null` when it is a publication already shown (same epoch as
   * the channel's last position, offset not above it). JOINED and HISTORY_LOST set the
   * position, a publication with offset > 0 moves it, a best-effort one (offset 0) leaves it,
   * LEFT removes the channel.
   */
  accept(event: ChannelEvent): ChannelUpdate | null {
    const { kind, channel, epoch, offset, body } = event;
    switch (kind) {
      case ChannelEventKind.Publication:
        if (offset > 0n) {
          const l = this.last.get(channel);
          if (l !== undefined && l.epoch === epoch && offset <= l.offset) {
            this._duplicates++;
            return null;
          }
          this.last.set(channel, { epoch, offset });
        }
        break;
      case ChannelEventKind.Joined:
      case ChannelEventKind.HistoryLost:
        this.last.set(channel, { epoch, offset });
        break;
      case ChannelEventKind.Left:
        this.last.delete(channel);
        break;
      default:
        return null; // A kind this version does not know: ignored (§12.2).
    }
    return { kind: KIND_NAMES[kind], channel, epoch, offset, body };
  }

  /**
   * Decodes a DATA payload of `CHANNEL_EVENT_MSG_ID` and takes it; `null` when it is a
   * duplicate or cannot be decoded (malformed, or a kind this version does not know: both
   * counted in {@link undecodable} and otherwise ignored).
   */
  acceptPayload(payload: Uint8Array | ArrayBuffer): ChannelUpdate | null {
    let event: ChannelEvent;
    try {
      event = decodeChannelEvent(payload);
    } catch (e) {
      if (!(e instanceof ProtocolError)) throw e;
      this._undecodable++;
      return null;
    }
    return this.accept(event);
  }

  /** The last position of every channel the session is a member of, by channel name (a copy). */
  positions(): Map<string, ChannelPosition> {
    const names = [...this.last.keys()].sort();
    return new Map(names.map((n) => [n, { ...this.last.get(n)! }]));
  }

  /** The last position of one channel, or `null` when the session is not a member. */
  position(channel: string): ChannelPosition | null {
    const p = this.last.get(channel);
    return p === undefined ? null : { ...p };
  }

  /** Publications dropped as already shown. */
  get duplicates(): number {
    return this._duplicates;
  }

  /** Channel event payloads dropped because they could not be decoded. */
  get undecodable(): number {
    return this._undecodable;
  }
}
