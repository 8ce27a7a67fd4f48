-- OURS: UPDATEs whose new tuple carries only "unchanged TOAST" columns (issue 16 bug 2; the native worker
-- updates the row with its old values), and the same on a table with a key (its SET keeps the key column)
UPDATE toast_only_full SET big = big, doc = doc WHERE doc->>'g' IN ('1', '2');

UPDATE toast_only_full SET big = big WHERE doc->>'g' = '7';

UPDATE toast_only SET big = big, doc = doc WHERE id < 5;

UPDATE toast_only SET id = id + 100 WHERE id = 8;
