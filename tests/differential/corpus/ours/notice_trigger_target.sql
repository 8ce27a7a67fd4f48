-- OURS: on both targets, after the copy: an ENABLE ALWAYS trigger that raises a 1 MB NOTICE per replicated
-- row (it must neither flood our log nor our memory), and an ENABLE REPLICA trigger that counts the rows it saw
-- (fires for replicated changes only)
CREATE TABLE history_seen (n bigint NOT NULL);
INSERT INTO history_seen VALUES (0);
CREATE FUNCTION loud() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  RAISE NOTICE 'row %: %', NEW.aid, repeat('N', 1000000);
  RETURN NEW;
END $$;
CREATE FUNCTION count_seen() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  UPDATE public.history_seen SET n = n + 1;  -- qualified: both apply workers run with an empty search_path
  RETURN NULL;
END $$;
CREATE TRIGGER history_loud BEFORE INSERT ON pgbench_history FOR EACH ROW EXECUTE FUNCTION loud();
ALTER TABLE pgbench_history ENABLE ALWAYS TRIGGER history_loud;
CREATE TRIGGER history_count AFTER INSERT ON pgbench_history FOR EACH ROW EXECUTE FUNCTION count_seen();
ALTER TABLE pgbench_history ENABLE REPLICA TRIGGER history_count;
